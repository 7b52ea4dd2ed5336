"""``quant_activations="auto"``: the fastest quantized-linear kernel mode whose kernel works here."""

import copy

import pytest
import torch

import hf_paged
from hf_paged import EngineConfig, PagedGenerator, SamplingParams
from hf_paged.cli import build_parser
from hf_paged.cli.engine import engine_options
from hf_paged.model.layers import quant_modes
from hf_paged.model.layers.quant_linear import QuantLinear
from tests.helpers import make_model, make_prompts


@pytest.fixture(autouse=True)
def fresh_choices():
    quant_modes.reset()
    yield
    quant_modes.reset()


def test_choose_mode_takes_the_best_geometric_mean_and_keeps_float_within_the_margin():
    # the Xeon AMX host's kernel timings (ms, decoder linears): bf16 slow at 1 row, far ahead at 16 and 64
    amx = {"float": {1: 5.4, 16: 37.1, 64: 51.5}, "int8": {1: 3.5, 16: 24.7, 64: 35.7},
           "bf16": {1: 8.6, 16: 9.5, 64: 16.6}}
    assert quant_modes.choose_mode(amx) == "bf16"
    assert quant_modes.choose_mode({m: amx[m] for m in ("float", "int8")}) == "int8"
    # only at one row does int8 win: an engine that runs one row takes it, a batching one keeps float
    mixed = {"float": {1: 100.0, 16: 500.0, 64: 1200.0}, "int8": {1: 75.0, 16: 470.0, 64: 1700.0}}
    assert quant_modes.choose_mode(mixed) == "float"
    assert quant_modes.choose_mode({m: {1: t[1]} for m, t in mixed.items()}) == "int8"
    # 5% faster is not enough to leave the exact mode
    assert quant_modes.choose_mode({"float": {1: 1.0}, "int8": {1: 0.95}}) == "float"
    assert quant_modes.row_counts(128) == (1, 16, 64) and quant_modes.row_counts(3) == (1, 3)
    assert quant_modes.row_counts(1) == (1,)


def layer(fmt="int4", n=96, k=64):
    return QuantLinear.from_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), None, fmt)


def test_auto_only_times_modes_whose_kernel_works(monkeypatch):
    timed = []

    def fake_timings(lyr, modes, rows):
        timed.append(list(modes))
        return {m: {r: {"float": 3.0, "int8": 2.0, "bf16": 1.0}[m] for r in rows} for m in modes}

    monkeypatch.setattr(quant_modes, "_time_modes", fake_timings)
    monkeypatch.setattr(quant_modes, "mode_available", lambda mode: mode != "bf16")  # a CPU without AMX-BF16
    assert quant_modes.fastest_mode(layer(), 8) == "int8" and timed == [["float", "int8"]]
    assert quant_modes.fastest_mode(layer(), 8) == "int8" and len(timed) == 1  # timed once per format and shape
    quant_modes.reset()
    monkeypatch.setattr(quant_modes, "mode_available", lambda mode: mode == "float")
    assert quant_modes.fastest_mode(layer(), 8) == "float" and len(timed) == 1  # nothing to time
    quant_modes.reset()
    monkeypatch.setattr(quant_modes, "mode_available", lambda mode: mode == "int8")  # no float kernel: torch's
    assert quant_modes.fastest_mode(layer(), 8) == "int8" and len(timed) == 1


def test_auto_measures_here_and_picks_a_working_mode():
    mode = quant_modes.fastest_mode(layer(), 4)
    assert mode in quant_modes.working_modes()
    timed = quant_modes._timings.get(("q4_1", 96, 64, (1, 4)))
    assert timed is None or (set(timed) == set(quant_modes.working_modes()) and all(
        set(t) == {1, 4} and all(s > 0 for s in t.values()) for t in timed.values()))
    assert quant_modes.describe("q4_1", 96, 64, 4).startswith(f"picks {mode}")


def test_auto_engine_gives_the_tokens_of_the_mode_it_picked():
    model = make_model(seed=5)
    prompts = make_prompts(3, lengths=[1, 9, 33], seed=2)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    kw = dict(num_blocks=64, max_num_seqs=3, quantization="int4")
    with PagedGenerator(model, quant_activations="auto", **kw) as engine:
        quantized = engine.executor.quantized
        picked = quantized.activations
        assert quantized.requested == "auto" and picked in quant_modes.working_modes()
        assert {m.activations for m in model.modules() if isinstance(m, QuantLinear)} == {picked}
        auto = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        with PagedGenerator(model, num_blocks=16, max_num_seqs=3, quantization="int4", quant_activations=picked) as b:
            assert b.executor.quantized is quantized  # the same layers, shared
        with PagedGenerator(model, num_blocks=16, max_num_seqs=3, quantization="int4", quant_activations="auto") as c:
            assert c.executor.quantized is quantized
        other = next(m for m in ("float", "int8") if m != picked)
        with pytest.raises(ValueError, match=f"runs it with quantization='int4', quant_activations='{picked}'"):
            PagedGenerator(model, num_blocks=16, quantization="int4", quant_activations=other)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    with PagedGenerator(model, quant_activations=picked, **kw) as explicit:
        assert [o.outputs[0].token_ids for o in explicit.generate(prompts, params, use_tqdm=False)] == auto


def test_auto_on_a_model_quantized_already_holds_its_pick():
    """Like a GGUF model: its QuantLinears run float until an engine says otherwise. "auto" keeps its pick held
    even where the pick is the mode they had, so another engine cannot switch them under it."""
    model = copy.deepcopy(make_model(seed=6))
    hf_paged.quantize_model(model, "int4")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    with PagedGenerator(model, num_blocks=16, max_num_seqs=2, quant_activations="auto") as engine:
        picked = engine.executor.quantized.activations
        assert picked in quant_modes.working_modes() and {m.activations for m in layers} == {picked}
        other = next(m for m in ("int8", "bf16") if m != picked)  # (a plain float engine is not checked)
        with pytest.raises(ValueError, match="close it first"):
            PagedGenerator(model, num_blocks=16, quant_activations=other)
    assert {m.activations for m in layers} == {"float"}


def test_auto_on_a_float_model_changes_nothing():
    model = make_model(seed=6)
    with PagedGenerator(model, num_blocks=16, max_num_seqs=2, quant_activations="auto") as engine:
        assert engine.executor.quantized is None
        assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_auto_in_the_config_and_on_the_command_line():
    assert EngineConfig(quantization="int4", quant_activations="auto").quant_activations == "auto"
    with pytest.raises(ValueError, match=r"one of \('float', 'int8', 'bf16', 'auto'\), got 'fastest'"):
        EngineConfig(quant_activations="fastest")
    args = build_parser().parse_args(["generate", "--quantization", "int4", "--quant-activations", "auto", "Hi"])
    assert engine_options(args) == {"quantization": "int4", "quant_activations": "auto"}
