"""Beam search with a LoRA adapter: every beam runs the search's adapter; equal to PEFT's own (unmerged)
``generate(num_beams=...)``; base searches in the same engine stay the base model's."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

import hf_paged  # noqa: E402
from hf_paged import BeamSearchParams, LoRARequest, PagedGenerator  # noqa: E402
from tests.helpers import make_model, make_prompts  # noqa: E402
from tests.test_lora import ADAPTERS, make_adapter  # noqa: E402

NEW, BEAMS = 8, 3
PARAMS = BeamSearchParams(beam_width=BEAMS, num_return_sequences=BEAMS, max_tokens=NEW, ignore_eos=True)


def stock_beams(model, prompt: list[int]) -> list[list[int]]:
    """Stock beam search's ``num_return_sequences`` beams (generated part), best first."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=BEAMS, num_return_sequences=BEAMS, max_new_tokens=NEW, do_sample=False,
                             early_stopping=False, length_penalty=1.0, eos_token_id=None, pad_token_id=0)
    return out[:, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    base = make_model(request.param)
    root = tmp_path_factory.mktemp(f"lora-beams-{request.param}")
    adapters = {}
    for i, name in enumerate(("a", "b"), start=1):
        adapters[name] = (LoRARequest(name, i, str(root / name)), make_adapter(base, root / name, 30 + i, **ADAPTERS[name]))
    return base, adapters


def test_beam_search_runs_the_adapter_and_base_searches_stay_base(setup):
    base, adapters = setup
    prompts = make_prompts(2, lengths=[9, 17], seed=7)
    want_base = [stock_beams(base, p) for p in prompts]
    want = {name: [stock_beams(model, p) for p in prompts] for name, (_, model) in adapters.items()}
    assert want["a"] != want_base and want["b"] != want_base and want["a"] != want["b"]  # the adapters show
    with PagedGenerator(base, enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=96) as engine:
        # searches of two adapters and of the base model advance in the same steps
        searches = {name: engine.start_beam_search(prompts, PARAMS, lora_request=req if req else None)
                    for name, req in [("a", adapters["a"][0]), ("b", adapters["b"][0]), (None, None)]}
        engine.run_until(lambda: all(s.done for s in searches.values()))
        got = {name: [[b.token_ids for b in o.sequences] for o in s.results(BEAMS)] for name, s in searches.items()}
        # a search alone on a fresh set of sequences: the same (and the beams forked from an adapter row keep it)
        alone = engine.beam_search(prompts, PARAMS, lora_request=adapters["b"][0])
        assert engine.kv_manager.num_used_blocks == 0
    assert got[None] == want_base
    assert got["a"] == want["a"] and got["b"] == want["b"]
    assert [[b.token_ids for b in o.sequences] for o in alone] == want["b"]


def test_one_adapter_per_search(setup):
    base, adapters = setup
    with PagedGenerator(base, enable_lora=True, max_lora_rank=8, num_blocks=32) as engine:
        with pytest.raises(TypeError, match="one lora_request"):
            engine.beam_search([[5, 6, 7]], PARAMS, lora_request=[adapters["a"][0]])


def test_wrapped_peft_model_beams_run_in_the_engine(setup):
    """``generate(num_beams=...)`` on a wrapped PeftModel with its active adapter runs in the engine and equals
    PEFT's own beams."""
    base, adapters = setup
    model = adapters["a"][1]
    prompt = make_prompts(1, lengths=[12], seed=8)[0]
    want = stock_beams(model, prompt)
    hf_paged.wrap(model, num_blocks=64, max_lora_rank=8)
    try:
        steps = model.paged.num_steps
        got = stock_beams(model, prompt)
        assert model.paged.num_steps > steps  # the engine ran it (no fallback to PEFT's generate)
    finally:
        hf_paged.unwrap(model)
    assert got == want
