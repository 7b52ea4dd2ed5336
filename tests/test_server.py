"""The OpenAI-compatible server, driven by the official ``openai`` client over a loopback port.

The default model answers the API tests; a tiny random model with the default tokenizer carries the
200-client and metrics tests.
"""

import asyncio
import json

import httpx
import openai
import pytest

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.cli import main
from hf_paged.model.default_model import DEFAULT_MODEL_NAME, load_default
from hf_paged.serving.protocol import apply_chat_template
from tests.serving_helpers import (
    TINY_NAME, default_tokenizer, scrape, serve, tiny_chat_model, used_blocks, wait_until,
)

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_server():
    model, tok = load_default()
    with serve(model, tok, DEFAULT_MODEL_NAME, max_num_seqs=16) as (url, loop):
        yield url, loop, tok


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=default_server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(loop, prompt, max_tokens: int, **kw):
    """What the engine answers alone, in process."""
    return loop.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))


def test_completions_equal_the_engine_and_report_usage(default_server, client):
    _, loop, tok = default_server
    want = greedy(loop, "The capital of France is", 12)
    r = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="The capital of France is", max_tokens=12,
                                  temperature=0)
    assert r.object == "text_completion" and r.model == DEFAULT_MODEL_NAME and r.id.startswith("cmpl-")
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(tok("The capital of France is")["input_ids"])
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    # streaming: the deltas add up to the same text
    chunks = list(client.completions.create(model=DEFAULT_MODEL_NAME, prompt="The capital of France is",
                                            max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason

    # several prompts (token ids too) in one call
    ids = tok("Once upon a time")["input_ids"]
    r = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=[ids, "Hello"], max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == greedy(loop, ids, 5).text and r.choices[1].text == greedy(loop, "Hello", 5).text


def test_chat_streaming_and_not(default_server, client):
    _, loop, tok = default_server
    want = greedy(loop, apply_chat_template(tok, CHAT), 24)
    r = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=CHAT, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == len(want.token_ids)

    stream = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=CHAT, max_completion_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_n_seed_stop_and_logprobs(default_server, client):
    _, loop, tok = default_server
    kw = dict(model=DEFAULT_MODEL_NAME, prompt="My favourite colour is", max_tokens=10, temperature=0.9)
    a = client.completions.create(n=3, seed=5, **kw)
    b = client.completions.create(n=3, seed=5, **kw)
    assert len(a.choices) == 3 and [c.text for c in a.choices] == [c.text for c in b.choices]
    assert 3 <= a.usage.completion_tokens <= 30  # counted over the 3 samples
    # sample i uses seed + i, so sample 1 equals a request seeded 6
    c = client.completions.create(n=1, seed=6, **kw)
    assert c.choices[0].text == a.choices[1].text

    # stop: the text ends before the stop string
    full = greedy(loop, "The capital of France is", 12).text
    word = full.split()[2]
    r = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="The capital of France is", max_tokens=12,
                                  temperature=0, stop=[word])
    assert r.choices[0].text == full[: full.index(word)] and r.choices[0].finish_reason == "stop"
    s = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=CHAT, max_tokens=24, temperature=0,
                                       stop="Paris", stream=True)
    assert "Paris" not in "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)

    # log-probabilities: the sampled token and the most likely alternatives
    r = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="The capital of France is", max_tokens=4,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == r.choices[0].text
    r = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=CHAT, max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_models_health_and_api_key(default_server, client):
    url, loop, tok = default_server
    models = client.models.list()
    assert [m.id for m in models.data] == [DEFAULT_MODEL_NAME]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    with serve(tiny_chat_model(tok), tok, TINY_NAME, api_key="sekret", num_blocks=64) as (key_url, _):
        bad = openai.OpenAI(base_url=key_url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model=TINY_NAME, prompt="Hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        r = httpx.get(key_url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        good = openai.OpenAI(base_url=key_url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model=TINY_NAME, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(key_url + "/health").status_code == 200  # health and metrics need no key


# 400s only; an unknown model (404), a body too large (413) and the other bad inputs are in test_server_errors.py
BAD = [
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "Hi", "max_tokens": -5}, "max_tokens", ">= 1"),
    ({"prompt": "Hi", "max_tokens": 10**6}, "max_tokens", "context length"),
    ({"prompt": "Hi", "max_tokens": "many"}, "max_tokens", "integer"),
    ({"prompt": "Hi", "n": 0}, "n", ">= 1"),
    ({"prompt": "Hi", "n": 1000}, "n", "max_num_seqs"),
    ({"prompt": "Hi", "temperature": -1}, "temperature", "[0.0, 2.0]"),
    ({"prompt": "Hi", "temperature": 3}, "temperature", "[0.0, 2.0]"),
    ({"prompt": "Hi", "temperature": "hot"}, "temperature", "number"),
    ({"prompt": "Hi", "top_p": 0}, "top_p", "(0.0, 1.0]"),
    ({"prompt": "Hi", "seed": -1}, "seed", "between 0 and"),
    ({"prompt": "Hi", "stop": [""]}, "stop", "non-empty"),
    ({"prompt": "Hi", "presence_penalty": 0.5}, "presence_penalty", "repetition_penalty"),
    ({"prompt": "Hi", "logprobs": 50}, "logprobs", "between 0 and 20"),
    ({"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [10**7]}, "prompt", "vocabulary"),
    ({"max_tokens": 3}, "prompt", "required"),
    ({"prompt": "Hi", "echo": True}, "echo", "not supported"),
]
BAD_CHAT = [
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": "hello"}, "messages", "non-empty"),
    ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role", "one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "text parts"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "needs a chat template that takes tools"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
]


def test_bad_fields_are_openai_400s_and_others_are_unaffected(default_server):
    url, loop, tok = default_server
    want = greedy(loop, apply_chat_template(tok, CHAT), 16).text

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            async def good():
                parts = []
                async with http.stream("POST", "/v1/chat/completions", json={
                        "messages": CHAT, "max_tokens": 16, "temperature": 0, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            parts.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
                return "".join(parts)

            running = asyncio.ensure_future(good())
            answers = []
            for body, _, _ in BAD:
                answers.append(await http.post("/v1/completions", json=body))
            for body, _, _ in BAD_CHAT:
                answers.append(await http.post("/v1/chat/completions", json=body))
            answers.append(await http.post("/v1/chat/completions", content=b"{not json"))
            answers.append(await http.post("/v1/chat/completions", content=b"[1, 2]"))
            return await running, answers

    text, answers = asyncio.run(main())
    assert text == want  # a client streaming meanwhile got its whole, right answer
    expected = BAD + BAD_CHAT + [(None, "body", "not valid JSON"), (None, "body", "JSON object")]
    for r, (body, param, words) in zip(answers, expected):
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (body, err)
        assert err["type"] == "invalid_request_error"
    assert httpx.get(url + "/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert used_blocks(loop) == 0


def test_disconnecting_clients_are_aborted_and_their_blocks_freed(default_server):
    url, loop, _ = default_server
    aborted = loop.num_finished_by_reason["abort"]
    body = {"messages": CHAT, "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data: ")
                if lines == 4:
                    assert used_blocks(loop) > 0
                    break  # leaving the block closes the connection mid-stream
    wait_until(lambda: loop.num_finished_by_reason["abort"] == aborted + 1, what="the streaming request's abort")
    wait_until(lambda: used_blocks(loop) == 0, what="its blocks")

    # a non-streaming client that gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=1.0)
    wait_until(lambda: loop.num_finished_by_reason["abort"] == aborted + 2, what="the non-streaming abort")
    wait_until(lambda: used_blocks(loop) == 0, what="its blocks")
    assert loop.num_live_requests == 0


@pytest.fixture(scope="module")
def tiny_server():
    tok = default_tokenizer()
    with serve(tiny_chat_model(tok), tok, TINY_NAME, num_blocks=1024, block_size=16, max_num_seqs=256) as (url, loop):
        yield url, loop, tok


def test_200_concurrent_streaming_clients(tiny_server):
    url, loop, tok = tiny_server
    prompts = [f"Request number {i}: tell me about item {i * 7 % 13}" for i in range(200)]
    reference = PagedGenerator(tiny_chat_model(tok), tok, num_blocks=1024, max_num_seqs=256)  # in process
    want = [o.text for o in reference.generate(
        prompts, [SamplingParams(max_tokens=8 + i % 5, temperature=0, ignore_eos=True) for i in range(200)],
        use_tqdm=False)]
    reference.close()
    steps = loop.engine.num_steps
    batch_sizes = []
    loop.add_observer(lambda info: batch_sizes.append(loop.last_batch_size))

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300,
                                    http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=256)))

        async def one(i):
            stream = await client.completions.create(model=TINY_NAME, prompt=prompts[i], max_tokens=8 + i % 5,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            await client.close()

    got = asyncio.run(main())
    assert got == want
    assert max(batch_sizes) > 100  # they were served as one continuous batch
    assert loop.engine.num_steps - steps < 200 * 8  # far fewer steps than one request at a time
    assert used_blocks(loop) == 0 and loop.num_live_requests == 0


def test_metrics_move_by_the_right_amounts(tiny_server):
    url, loop, tok = tiny_server
    before = scrape(url)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    usages = []
    for i in range(3):
        r = client.completions.create(model=TINY_NAME, prompt=f"metrics {i}", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
        usages.append(r.usage)
    chunks = list(client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    usages.append(chunks[-1].usage)
    after = scrape(url)

    def delta(name):
        return after[name] - before.get(name, 0.0)

    prompt = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert generated == 3 * 5 + 4
    assert delta("hf_paged:prompt_tokens_total") == prompt
    assert delta("hf_paged:generation_tokens_total") == generated
    assert delta("hf_paged:prefix_cache_queries_total") == prompt
    assert delta("hf_paged:request_success_total{finished_reason=length}") == 4
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert delta(f"hf_paged:{hist}_count") == 4, hist
    assert delta("hf_paged:request_generation_tokens_sum") == generated
    assert delta("hf_paged:request_prompt_tokens_sum") == prompt
    assert delta("hf_paged:inter_token_latency_seconds_count") == generated - 4  # every token after the first
    assert delta("hf_paged:iteration_steps_total") >= 5
    assert after["hf_paged:num_requests_running"] == 0 and after["hf_paged:num_requests_waiting"] == 0
    assert after["hf_paged:kv_cache_usage_perc"] == 0 and after["hf_paged:kv_cache_blocks"] == 1024
    for name in ("num_preemptions_total", "prefix_cache_hits_total", "spec_decode_num_drafts_total",
                 "spec_decode_num_accepted_tokens_total"):
        assert f"hf_paged:{name}" in after


def test_a_failing_step_is_an_error_for_its_clients_only(tiny_server, monkeypatch):
    url, loop, tok = tiny_server
    runner = loop.engine.executor.runner
    original = runner.execute
    state = {"fail": True}

    def flaky(out):
        if state["fail"]:
            state["fail"] = False
            raise RuntimeError("injected failure")
        return original(out)

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    monkeypatch.setattr(runner, "execute", flaky)
    with pytest.raises(openai.InternalServerError, match="injected failure"):
        client.completions.create(model=TINY_NAME, prompt="fail me", max_tokens=4)
    state["fail"] = True
    with pytest.raises(openai.APIError, match="injected failure"):
        list(client.completions.create(model=TINY_NAME, prompt="fail me too", max_tokens=4, stream=True))
    assert client.completions.create(model=TINY_NAME, prompt="fine", max_tokens=3).usage.completion_tokens >= 1
    assert used_blocks(loop) == 0


def test_full_queue_is_a_503(tiny_server):
    _, _, tok = tiny_server
    with serve(tiny_chat_model(tok), tok, TINY_NAME, num_blocks=64, max_num_seqs=1, max_waiting_requests=1) as (url, loop):
        import threading

        hold = threading.Event()
        loop.call(lambda e: hold.wait(30))  # the loop is busy: the first request waits in the queue

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                first = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))
                await asyncio.sleep(0.3)
                second = await http.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
                hold.set()
                return await first, second

        first, second = asyncio.run(main())
        assert first.status_code == 200
        assert second.status_code == 503 and second.headers["retry-after"] == "1"
        assert second.json()["error"]["code"] == "queue_full"


def test_cli_checks_before_loading(capsys):
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert main(["serve", "--model", "/no/such/folder"]) == 2
    assert main(["bench", "chat", "--clients", "4"]) == 2
    assert "serve workload only" in capsys.readouterr().err
    assert main(["bench", "serve", "--clients", "0"]) == 2
    assert main(["serve", "--speculative-config", "{ngram"]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["chat", "--speculative-config", '{"method": "medusa"}']) == 2
    assert "medusa" in capsys.readouterr().err


def test_missing_extra_names_it(monkeypatch, tiny_server):
    import sys

    from hf_paged.serving import server
    from hf_paged.serving.metrics import ServingMetrics
    from hf_paged.ui import ChatDemo

    _, loop, _ = tiny_server
    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "gradio", None)
    with pytest.raises(ImportError, match=r"hf-paged\[serve\]"):
        server.build_app(loop, None)
    with pytest.raises(ImportError, match=r"hf-paged\[serve\]"):
        ServingMetrics(loop, "m")
    with pytest.raises(ImportError, match=r"hf-paged\[serve\]"):
        ChatDemo(loop).build()


def test_bench_serve_runs_the_real_server(capsys):
    from hf_paged.bench.serve import percentile, serve as bench_serve

    payload = bench_serve(clients=[2], num_requests=2, max_tokens=4)
    level = payload["levels"][2]
    assert level["same_text"] == "2/2" and level["http_tokens"] == level["generate_tokens"] > 0
    assert level["ratio_http_over_generate"] > 0 and level["ttft_ms_p50"] > 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["workload"] == "serve"
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile([1.0, 2.0], 99) == 2.0
