"""What step runners hand back besides logits (hidden states of chosen decoder layers, for an EAGLE head), and
draft-model steps on the native decode program (a draft model of its own, and a ``self:N`` draft)."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_paged import PagedGenerator, SamplingParams
from tests.helpers import make_model, make_prompts, stock_greedy

NATIVE = dict(prepack_weights="native")  # the packing the native program runs on (as in test_native_program)


def _stock_hidden(model, prompt: list[int], layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Each decoder layer's output over ``prompt`` from the stock forward (hooks on the stock modules)."""
    got = {}
    handles = [model.model.layers[i].register_forward_hook(
        lambda m, a, out, i=i: got.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0])) for i in layers]
    try:
        with torch.no_grad():
            model(torch.tensor([prompt]))
    finally:
        for h in handles:
            h.remove()
    return got


@pytest.mark.parametrize("engine_kw", [dict(fuse_layers=False, prepack_weights=False), NATIVE, dict(decode_runner="static")],
                         ids=["eager", "native", "buckets"])
def test_steps_hand_back_the_hidden_states_asked_for(engine_kw):
    model = make_model("llama", seed=4)
    last = model.config.num_hidden_layers - 1
    prompt = make_prompts(1, [7], seed=4)[0]
    with PagedGenerator(model, num_blocks=32, block_size=4, enable_prefix_caching=False, **engine_kw) as engine:
        runner = engine.executor.runner
        with pytest.raises(ValueError, match=r"hidden layers \[9\] are not decoder layer indices"):
            runner.capture_hidden((0, 9))
        runner.capture_hidden((last, 0))
        assert runner.hidden_layers == (0, last)
        seen = []
        execute = runner.execute

        def spy(out):
            result = execute(out)
            seen.append({i: h.clone() for i, h in runner.last_hidden.items()})
            return result

        runner.execute = spy
        out = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
        runner.execute = execute
        program = runner.fast if "prepack_weights" in engine_kw and engine_kw["prepack_weights"] else None
        assert program is None or type(program).__name__ != "DecodeProgram" or program.num_runs > 0
    tokens = prompt + list(out.outputs[0].token_ids)
    want = _stock_hidden(model, tokens[:-1], (0, last))
    # step 0 is the prefill (every prompt row), then one row per decode step
    rows = {i: torch.cat([s[i] for s in seen if i in s]) for i in (0, last)}
    for i in (0, last):
        assert rows[i].shape == want[i].shape
        torch.testing.assert_close(rows[i], want[i], rtol=1e-4, atol=1e-5)


def test_capture_off_again_and_native_program_records_the_copies():
    model = make_model("llama", seed=5)
    with PagedGenerator(model, num_blocks=32, block_size=4, **NATIVE) as engine:
        runner = engine.executor.runner
        program = runner.fast
        runner.capture_hidden((1,))
        engine.generate(make_prompts(2, [3, 5], seed=1), SamplingParams(max_tokens=3, temperature=0.0))
        assert program.capture == (1,) and program.num_runs > 0 and set(runner.last_hidden) == {1}
        runner.capture_hidden(())
        engine.generate(make_prompts(1, [4], seed=2), SamplingParams(max_tokens=2, temperature=0.0))
        assert program.capture == () and runner.last_hidden == {}


@pytest.mark.parametrize("draft", ["self:1", "model"])
def test_draft_model_steps_run_on_the_native_program(draft):
    target = make_model("llama", seed=13)
    spec_model = "self:1" if draft == "self:1" else copy.deepcopy(make_model("llama", seed=14))
    spec = dict(method="draft_model", model=spec_model, num_speculative_tokens=3)
    prompts = make_prompts(3, [6, 9, 4], seed=6)
    with PagedGenerator(target, num_blocks=96, max_num_seqs=3, speculative_config=spec, **NATIVE) as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
        proposer = next(iter(engine.executor.runner.speculator.proposers.values()))
        assert proposer.fast is not None and proposer.fast.num_runs > 0, proposer.fast and proposer.fast.why_not
        assert engine.stats().spec_num_draft_tokens > 0
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == stock_greedy(target, prompt, 12)
    if draft == "model":  # the draft model's own layer objects were given back with the engine
        assert type(spec_model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
        assert spec_model.config._attn_implementation != "hf_paged"
