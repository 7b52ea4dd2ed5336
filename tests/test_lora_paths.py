"""Adapters on the engine's other ways in: ``stream(..., lora_request=)``, ``add_request(..., lora_request=)`` and
speculative decoding with a draft model (the draft runs the base model, also a ``self:N`` draft that shares the
target's layer objects; the target's verification applies the adapter): greedy tokens equal PEFT's own."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from hf_paged import LoRARequest, PagedGenerator, SamplingParams  # noqa: E402
from tests.helpers import make_model, make_prompts, stock_greedy  # noqa: E402
from tests.test_lora import ADAPTERS, make_adapter  # noqa: E402

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    base = make_model("llama")
    folder = tmp_path_factory.mktemp("lora-paths")
    peft_model = make_adapter(base, folder, seed=61, **ADAPTERS["b"])
    return base, LoRARequest("b", 1, str(folder)), peft_model


def test_stream_and_add_request_run_the_adapter(adapter):
    base, req, peft_model = adapter
    prompts = make_prompts(2, lengths=[10, 14], seed=62)
    refs = [stock_greedy(peft_model, p, MAX_TOKENS) for p in prompts]
    assert refs != [stock_greedy(base, p, MAX_TOKENS) for p in prompts]
    with PagedGenerator(base, enable_lora=True, max_lora_rank=8, num_blocks=48) as engine:
        items = engine.stream(prompts[0], GREEDY, lora_request=req)
        streamed = [t for item in items for t in item.outputs[0].token_ids]
        assert streamed == refs[0]
        base_stream = [t for item in engine.stream(prompts[0], GREEDY) for t in item.outputs[0].token_ids]
        assert base_stream == stock_greedy(base, prompts[0], MAX_TOKENS)
        rid = engine.add_request(prompts[1], GREEDY, lora_request=req)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert done[rid] == refs[1]


@pytest.mark.parametrize("draft", ["self:1", "other"])
def test_draft_model_runs_base_and_verification_the_adapter(adapter, draft):
    base, req, peft_model = adapter
    names = ["b", None, "b"]
    prompts = make_prompts(len(names), lengths=[16, 16, 20], seed=63)
    refs = [stock_greedy(peft_model if n else base, p, MAX_TOKENS) for p, n in zip(prompts, names)]
    spec = {"method": "draft_model", "num_speculative_tokens": 3,
            "model": draft if draft == "self:1" else make_model("llama", seed=1)}
    with PagedGenerator(base, enable_lora=True, max_lora_rank=8, num_blocks=64, speculative_config=spec) as engine:
        outs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=[req if n else None for n in names])
        stats = engine.stats()
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert stats.spec_num_draft_tokens > 0  # the draft proposed: verification steps ran with the adapter rows


def test_structured_output_rows_keep_their_adapter(tmp_path):
    """Structured rows (a regex every text matches, so the constraint itself never changes a token) of an
    adapter and of the base model in one batch: greedy tokens equal PEFT's and the base model's own, so the
    grammar's steps run each row with its adapter."""
    pytest.importorskip("xgrammar")
    from hf_paged import StructuredOutputsParams
    from tests.serving_helpers import default_tokenizer, tiny_chat_model

    tokenizer = default_tokenizer()
    model = tiny_chat_model(tokenizer)
    peft_model = make_adapter(model, tmp_path, seed=33, r=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])
    req = LoRARequest("s", 1, str(tmp_path))
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in ("Tell me a story about", "hi there")] * 2
    rows = [peft_model, peft_model, model, model]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(regex=r"[\s\S]*"))
    refs = [stock_greedy(m, p, MAX_TOKENS, eos_token_id=tokenizer.eos_token_id) for m, p in zip(rows, prompts)]
    assert refs[:2] != refs[2:]  # the adapter changes the tokens
    with PagedGenerator(model, tokenizer, enable_lora=True, max_lora_rank=8, num_blocks=64) as engine:
        outs = engine.generate(prompts, params, use_tqdm=False, lora_request=[req, req, None, None])
    assert [o.outputs[0].token_ids for o in outs] == refs
