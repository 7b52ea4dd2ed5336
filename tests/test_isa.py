"""HF_PAGED_ISA: forcing the kernels' instruction-set level below the host's (hf_paged/kernels/cpu/isa.py)."""

import os
import subprocess
import sys

import pytest

from hf_paged import EngineConfig
from hf_paged.kernels.cpu import isa
from hf_paged.kernels.cpu.native import NativeLibrary
from hf_paged.model.layers.quant_linear import _FUNCTIONS

ZEN3 = frozenset("sse4_2 avx avx2 fma f16c bmi2".split())
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
SPR = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}
x86_only = pytest.mark.skipif(isa.host_level() is None, reason="needs an x86 CPU with AVX2")


def test_host_levels_from_flags():
    assert isa.host_level(ZEN3) == "avx2"
    assert isa.host_level(ZEN4) == "avx512"
    assert isa.host_level(SPR) == "amx"
    assert isa.host_level(frozenset({"sse4_2", "avx"})) is None


@pytest.mark.parametrize(("value", "flags", "want"), [
    ("", ZEN3, None), ("native", SPR, None), ("AVX2", SPR, "avx2"), ("avx512", SPR, "avx512"),
    ("avx2", ZEN4, "avx2"), ("amx", SPR, "amx"),
])
def test_forced_level(value, flags, want, monkeypatch):
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    assert isa.forced_level(value, flags) == want


@pytest.mark.parametrize(("value", "flags", "match"), [
    ("sse", ZEN3, "expected one of avx2, avx512, amx or native"),
    ("avx512", ZEN3, "only goes up to avx2"),
    ("amx", ZEN4, "only goes up to avx512"),
    ("avx2", frozenset({"avx"}), "no x86 AVX2 level"),
])
def test_bad_levels_are_refused_by_name(value, flags, match, monkeypatch):
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    with pytest.raises(ValueError, match=match):
        isa.forced_level(value, flags)


def test_engine_config_refuses_a_bad_level(monkeypatch):
    monkeypatch.setenv(isa.ENV, "avx1024")
    with pytest.raises(ValueError, match="HF_PAGED_ISA='avx1024'"):
        EngineConfig()


@x86_only
def test_forced_avx2_builds_the_kernels_without_avx512(monkeypatch, tmp_path):
    """The kernel's vector width is a compile-time choice: 8 floats under AVX2, 16 where AVX-512 is built in."""
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path))
    monkeypatch.setenv(isa.ENV, "avx2")
    lib = NativeLibrary("quant_gemm.c", _FUNCTIONS, what="test build").load()
    assert lib is not None
    assert lib.hfq_vector_width() == 8
    assert "-march=x86-64-v3" in NativeLibrary("quant_gemm.c", {}).flags
    monkeypatch.delenv(isa.ENV)
    native = NativeLibrary("quant_gemm.c", _FUNCTIONS, what="test build").load()
    assert native.hfq_vector_width() == (16 if isa.host_level() in ("avx512", "amx") else 8)
    assert len(list((tmp_path / "kernels").glob("quant_gemm-*.so"))) == 2  # one build per level


@x86_only
def test_forced_avx2_caps_torch_and_is_reported():
    env = {**os.environ, isa.ENV: "avx2"}
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(name, None)
    code = ("import hf_paged, os, torch; from hf_paged.kernels.cpu import isa; "
            "print(torch.backends.cpu.get_cpu_capability(), os.environ['ONEDNN_MAX_CPU_ISA'], isa.describe())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split()[:3] == ["AVX2", "AVX2", "avx2"]
    assert "forced by HF_PAGED_ISA" in out.stdout
