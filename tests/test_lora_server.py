"""The server's LoRA side: load and unload adapters at run time, the ``model`` field picks one (PEFT's tokens),
/v1/models lists them under their base, an unknown name is a 404 naming it, a bad folder a 400 naming the file
(the server keeps serving), and /metrics counts requests per adapter."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.helpers import make_prompts, stock_greedy  # noqa: E402
from tests.serving_helpers import TINY_NAME, default_tokenizer, scrape, serve, tiny_chat_model  # noqa: E402
from tests.test_lora import make_adapter  # noqa: E402


def test_load_pick_list_unload_and_metrics(tmp_path):
    tokenizer = default_tokenizer()
    model = tiny_chat_model(tokenizer)
    peft_model = make_adapter(model, tmp_path / "upper", seed=31, r=4, target_modules=["q_proj", "down_proj"])
    (tmp_path / "broken").mkdir()
    prompt = make_prompts(1, lengths=[10], seed=5)[0]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    with serve(model, tokenizer, TINY_NAME, enable_lora=True, max_lora_rank=8, num_blocks=64) as (url, _loop):
        load = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "upper", "lora_path": str(tmp_path / "upper")},
                          timeout=60)
        assert load.status_code == 200, load.text
        bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(tmp_path / "broken")},
                         timeout=60)
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        cards = {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
        assert cards["upper"]["parent"] == TINY_NAME and "b" not in cards
        assert cards["upper"]["root"] == str(tmp_path / "upper") and cards[TINY_NAME].get("parent") is None

        out = httpx.post(url + "/v1/completions", json={**body, "model": "upper"}, timeout=60).json()
        base = httpx.post(url + "/v1/completions", json={**body, "model": TINY_NAME}, timeout=60).json()
        ids = tokenizer(out["choices"][0]["text"], add_special_tokens=False).input_ids
        expected = stock_greedy(peft_model, prompt, 6)
        assert tokenizer.decode(expected) == out["choices"][0]["text"], ids
        assert tokenizer.decode(stock_greedy(model, prompt, 6)) == base["choices"][0]["text"]

        missing = httpx.post(url + "/v1/completions", json={**body, "model": "nope"}, timeout=30)
        assert missing.status_code == 404 and "'nope'" in missing.json()["error"]["message"]
        metrics = scrape(url)
        assert metrics["hf_paged:model_requests_total{lora_name=upper}"] == 1
        assert metrics[f"hf_paged:model_requests_total{{lora_name={TINY_NAME}}}"] == 1

        gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "upper"}, timeout=30)
        assert gone.status_code == 200, gone.text
        again = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "upper"}, timeout=30)
        assert again.status_code == 404 and "'upper'" in again.json()["error"]["message"]
        assert httpx.post(url + "/v1/completions", json={**body, "model": "upper"}, timeout=30).status_code == 404


def test_load_without_enable_lora_is_a_400(tmp_path):
    tokenizer = default_tokenizer()
    with serve(tiny_chat_model(tokenizer), tokenizer, TINY_NAME, num_blocks=32) as (url, _loop):
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}, timeout=30)
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def test_chat_page_answers_with_the_chosen_adapter(tmp_path):
    from hf_paged import LoRARequest, SamplingParams, StructuredOutputsParams
    from hf_paged.ui.chat import BASE_CHOICE, ERROR_PREFIX, ChatDemo, build_prompt

    tokenizer = default_tokenizer()
    model = tiny_chat_model(tokenizer)
    make_adapter(model, tmp_path, seed=33, r=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])
    with serve(model, tokenizer, TINY_NAME, enable_lora=True, max_lora_rank=8, num_blocks=64) as (_url, loop):
        request = LoRARequest("shout", 1, str(tmp_path))
        loop.call(lambda e: e.add_lora(request)).result(60)
        demo = ChatDemo(loop, max_tokens=8)
        assert demo.adapters() == ["shout"]
        page = demo.build()  # the page's drop-down offers the base model and the loaded adapters
        dropdown = next(b for b in page.blocks.values() if getattr(b, "elem_id", None) == "hfp-adapter")
        assert [c[1] if isinstance(c, tuple) else c for c in dropdown.choices] == [BASE_CHOICE, "shout"]
        assert dropdown.visible and dropdown.value == BASE_CHOICE

        def answer(adapter: str) -> str:
            *_, (shown, _conv, _box) = demo.respond("hi", [], "", 0.0, 1.0, 8, "s", adapter=adapter)
            return shown[-1]["content"]

        prompt = build_prompt(tokenizer, "", [{"role": "user", "content": "hi"}])
        params = SamplingParams(max_tokens=8, temperature=0.0, top_p=1.0)
        with_adapter = loop.add_request(prompt, params, lora_request=request).result(60).outputs[0].text
        base = loop.add_request(prompt, params).result(60).outputs[0].text
        assert with_adapter != base
        assert answer("shout") == with_adapter and answer(BASE_CHOICE) == base
        assert answer("nope").startswith(ERROR_PREFIX) and "'nope'" in answer("nope")
        # structured output keeps its constraint on an adapter's row
        choice = SamplingParams(max_tokens=8, temperature=0.0,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        assert loop.add_request(prompt, choice, lora_request=request).result(60).outputs[0].text in ("yes", "no")


def test_unload_while_a_request_uses_the_adapter_is_a_400(tmp_path):
    """The engine's next step is held while a request of the adapter is admitted: unloading it then is a 400 that
    says it is in use, the request still finishes, and afterwards the unload goes through."""
    import threading
    import time

    tokenizer = default_tokenizer()
    model = tiny_chat_model(tokenizer)
    make_adapter(model, tmp_path, seed=35, r=4, target_modules=["q_proj"])
    body = {"prompt": make_prompts(1, lengths=[8], seed=6)[0], "max_tokens": 4, "temperature": 0, "model": "a"}
    with serve(model, tokenizer, TINY_NAME, enable_lora=True, max_lora_rank=8, num_blocks=64) as (url, loop):
        load = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)},
                          timeout=60)
        assert load.status_code == 200, load.text
        engine, release, done = loop.engine, threading.Event(), {}
        step = engine.step

        def held_step():
            release.wait(60)
            return step()

        engine.step = held_step
        worker = threading.Thread(target=lambda: done.update(r=httpx.post(url + "/v1/completions", json=body,
                                                                          timeout=120)))
        worker.start()
        try:
            deadline = time.monotonic() + 60
            while not engine.scheduler.sequences and time.monotonic() < deadline:
                time.sleep(0.02)
            busy = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=30)
        finally:
            release.set()
            worker.join(120)
        assert busy.status_code == 400 and "in use by 1" in busy.json()["error"]["message"], busy.text
        assert done["r"].status_code == 200, done["r"].text
        gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=30)
        assert gone.status_code == 200, gone.text
