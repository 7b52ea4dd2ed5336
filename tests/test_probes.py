"""Fast paths are probed, not assumed: each probe's failure is forced and the fallback keeps exact parity."""

import logging
import os
import stat

import pytest
import torch

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.kernels.cpu import attention as cpu_attention, fused_ops, isa, probes
from hf_paged.kernels.cpu import packed_linear
from tests.helpers import make_model, make_prompts, stock_greedy

PROMPTS = make_prompts(4, [1, 9, 40, 70], seed=3)
NEW = 12


def reset_fast_paths() -> None:
    """Forget every probe result, timing and loaded native library: the next use probes afresh."""
    probes.reset()
    packed_linear.reset()
    cpu_attention.reset()
    fused_ops.reset()


@pytest.fixture(autouse=True)
def fresh_probes():
    reset_fast_paths()
    yield
    reset_fast_paths()  # later tests probe the real host again


def _parity(**engine_kw) -> PagedGenerator:
    """Run the tiny model through an engine; its greedy tokens must equal stock generate's."""
    model = make_model("llama", seed=3)
    engine = PagedGenerator(model, num_blocks=64, block_size=4, **engine_kw)
    try:
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        engine.close()
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == stock_greedy(model, prompt, NEW)
    return engine


def test_probe_runs_once_and_reports_a_one_line_reason():
    calls = []

    def failing(dtype):
        calls.append(dtype)
        raise RuntimeError("no such instruction\nsecond line")

    probes.register("test.failing", failing)
    first = probes.probe("test.failing", torch.float32)
    assert not first and first.reason == "RuntimeError: no such instruction"
    assert probes.probe("test.failing", torch.float32) is first and calls == [torch.float32]
    with pytest.raises(ValueError, match="unknown fast path 'nope'"):
        probes.probe("nope", torch.float32)


def test_onednn_op_that_raises_is_skipped_and_parity_holds(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("mkldnn_reorder_linear_weight: forced failure")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", broken)
    assert not packed_linear.available("onednn", torch.float32)
    assert "forced failure" in packed_linear.unavailable_reason("onednn", torch.float32)
    engine = _parity()
    assert engine.packed is None or "onednn" not in engine.packed.packed_kinds.values()


def test_packing_with_wrong_results_is_skipped_and_parity_holds(monkeypatch):
    for cls in (packed_linear.OneDnnPackedWeight, packed_linear.PackedWeight, packed_linear.NativePackedWeight):
        original = cls.linear
        monkeypatch.setattr(cls, "linear", lambda self, x, b, _o=original: _o(self, x, b) * 1.01)
    assert not packed_linear.available("onednn", torch.float32)
    assert not packed_linear.available("mkl", torch.float32)
    assert not packed_linear.available("native", torch.float32)
    assert "differs from plain torch" in packed_linear.unavailable_reason("mkl", torch.float32)
    engine = _parity()
    assert engine.packed is None  # nothing left to pack with: plain F.linear
    with pytest.raises(RuntimeError, match="prepack_weights=True: no nn.Linear weight .* differs from plain torch"):
        PagedGenerator(make_model("llama", seed=3), num_blocks=16, prepack_weights=True)


def test_failing_compiler_falls_back_to_torch_attention(monkeypatch):
    monkeypatch.setenv("CC", "false")
    assert not cpu_attention.available(torch.float32)
    assert "building with false failed" in cpu_attention.unavailable_reason(torch.float32)
    engine = _parity()
    assert engine.backend == "torch" and engine.fused is None  # the fused layers' C kernels are off too
    assert "building with false failed" in fused_ops.unavailable_reason(torch.float32)
    assert "building with false failed" in packed_linear.unavailable_reason("native", torch.float32)
    assert engine.packed is None or engine.packed.kinds.get(torch.float32) != "native"  # oneDNN/MKL/F.linear instead
    with pytest.raises(RuntimeError, match="fuse_layers=True: RuntimeError: building with false failed"):
        PagedGenerator(make_model("llama", seed=3), num_blocks=16, fuse_layers=True)
    with pytest.raises(RuntimeError, match="attention_backend='cpu' needs its native kernel.*building with false failed"):
        PagedGenerator(make_model("llama", seed=3), num_blocks=16, attention_backend="cpu")


def test_hanging_compiler_is_time_limited(monkeypatch, tmp_path):
    cc = tmp_path / "slowcc"
    cc.write_text("#!/bin/sh\nsleep 60\n")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("HF_PAGED_CC_TIMEOUT", "1")
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path / "cache"))
    assert not cpu_attention.available(torch.float32)
    assert "timed out after 1 s" in cpu_attention.unavailable_reason(torch.float32)


def test_native_kernel_with_wrong_results_is_skipped(monkeypatch):
    original = cpu_attention.paged_attention_native

    def wrong(query, k_cache, v_cache, block_tables, seq_lens, cu, seq_ids, out, *args):
        original(query, k_cache, v_cache, block_tables, seq_lens, cu, seq_ids, out, *args)
        out.mul_(0.5)

    monkeypatch.setattr(cpu_attention, "paged_attention_native", wrong)
    assert not cpu_attention.available(torch.float32)
    engine = _parity()
    assert engine.backend == "torch"


def test_every_fast_path_forced_off_keeps_parity(monkeypatch):
    monkeypatch.setenv("HF_PAGED_NO_NATIVE", "1")
    monkeypatch.setattr(packed_linear, "_mkl", lambda: None)
    monkeypatch.setattr(packed_linear, "_onednn_built", lambda: False)
    engine = _parity()
    assert engine.backend == "torch" and engine.packed is None


@pytest.mark.parametrize("prepack", [None, False])
def test_bf16_model_runs_through_the_engine(prepack):
    model = make_model("llama", seed=3, dtype=torch.bfloat16)
    engine = PagedGenerator(model, num_blocks=64, block_size=4, prepack_weights=prepack)
    try:
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        engine.close()
    assert all(len(o.token_ids) == NEW and all(0 <= t < 512 for t in o.token_ids) for o in outs)
    if prepack is None and engine.packed is not None:
        assert set(engine.packed.packed_kinds) == {torch.bfloat16}


def test_env_reports_versions_features_and_kernel_choices(capsys, monkeypatch):
    import json

    from hf_paged.cli import main

    def broken(*args, **kwargs):
        raise RuntimeError("bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", broken)
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["versions"]["torch"] == torch.__version__ and info["versions"]["hf-paged"]
    assert "avx2" in info["cpu"]["features"] or "asimd" in info["cpu"]["features"]
    assert info["cpu"]["logical_cpus"] == os.cpu_count()
    for dtype in ("fp32", "bf16"):
        assert set(info["kernels"][dtype]) == {"linear", "attention", "layers"}
        assert info["kernels"][dtype]["layers"].startswith("fused C kernels")
    assert "onednn unavailable: RuntimeError: bf16 path needs the cpu support avx512bw" in info["kernels"]["bf16"]["linear"]
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    for line in ("vector features:", "openmp runtime:", "allocator:", "c compiler:", "fp32 linear:", "bf16 attention:", "fp32 decoder layers:"):
        assert line in text
    quant = info["quantized_linears"]
    assert set(quant) == {"float", "int8", "bf16", "auto"} and quant["float"] == "C kernel (quant_gemm.c)"
    assert quant["auto"].split()[:2] in (["picks", "float"], ["picks", "int8"], ["picks", "bf16"])
    if info["cpu"]["features"].get("amx_bf16") and isa.level() == "amx":  # (HF_PAGED_ISA below amx: no tiles)
        assert quant["bf16"] == "C kernel (quant_bf16.c)"
    else:  # the mode's fallback, with the probe's reason
        assert quant["bf16"].startswith("the float kernel instead: RuntimeError: this CPU (or its OS) has no AMX-BF16")
    assert "quantized linears, bf16 activations: " in text


def test_env_prints_no_fallback_warning_before_its_report(capsys, caplog, monkeypatch):
    """A quantized-linear mode that falls back here (bf16 without AMX) is a line of the report, not a warning
    printed above it; a layer that then runs in that mode still warns, once."""
    from hf_paged.cli import main
    from hf_paged.model.layers import quant_linear as ql

    def no_amx(dtype):
        raise RuntimeError("no AMX-BF16 tiles here (test)")

    monkeypatch.setitem(probes._PROBES, "linear.quant_bf16", no_amx)
    monkeypatch.setattr(ql, "_warned", set())
    probes.reset("linear.quant_bf16")
    try:
        with caplog.at_level(logging.WARNING):
            assert main(["env"]) == 0
            out, err = capsys.readouterr()
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
            assert err == ""
            assert ("quantized linears, bf16 activations: the float kernel instead: RuntimeError: no AMX-BF16 tiles "
                    "here (test)") in out
            assert ql.kernel("bf16")[1] == "float"  # a layer in bf16 mode: warned now, once
            ql.kernel("bf16")
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 1 and "bf16 activations: float activations instead" in warned[0], warned
    finally:
        probes.reset("linear.quant_bf16")
