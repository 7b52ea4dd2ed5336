"""Weight-only quantized linears (``csrc/quant_gemm.c``): the dequantized weights times the activations, up to
the fp32 summation order, per format, against GGUF's own numpy dequantization as the reference."""

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hf_paged.model.layers import quant_linear as ql
from hf_paged.model.layers.quant_linear import FORMATS, QuantLinear

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

needs_native = pytest.mark.skipif(ql.QUANT_GEMM.load() is None, reason="quantized kernel not built here")
LIBS = {"host": ql.QUANT_GEMM, "avx2": ql.QUANT_GEMM_AVX2}


def _reference_weight(layer: QuantLinear) -> torch.Tensor:
    """GGUF's numpy dequantization for its formats; q * scale for our int8 (computed here, not by the module)."""
    if layer.fmt == "int8":
        q = layer.qweight.view(torch.int8).float()
        return q * layer.scales[:, None]
    qtype = getattr(GGMLQuantizationType, layer.fmt.upper())
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(layer.qweight.numpy(), qtype)))


def _case(fmt, n=37, k=96, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return QuantLinear.from_weight(w, b, fmt), w


@needs_native
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_equals_dequantize_then_linear(fmt, rows, lib):
    """Odd N (37), K of three blocks; the host build (AVX-512 here) and the AVX2 + FMA baseline built beside it."""
    native = LIBS[lib].load()
    if native is None:
        pytest.skip(f"{lib} build failed: {LIBS[lib].why}")
    if lib == "avx2":
        assert native.hfq_vector_width() == 8
    for bias in (True, False):
        layer, _ = _case(fmt, bias=bias, seed=rows)
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows + 1))
        want = F.linear(x.double(), _reference_weight(layer).double(), None if layer.bias is None else layer.bias.double())
        got = layer._native(x, native)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_and_dequantize(fmt):
    """forward at decode and prefill row counts (the latter dequantizes per call), 3-d input, rows that do not
    depend on the batch, and the C dequantization bitwise equal to GGUF's."""
    layer, w = _case(fmt)
    ref = _reference_weight(layer)
    assert torch.equal(layer.dequantize(), ref)
    assert torch.equal(ql.dequantize_torch(layer.qweight, fmt, layer.scales, 96), ref)
    x = torch.randn(2, 20, 96, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(layer(x), F.linear(x, ref, layer.bias), atol=1e-4, rtol=1e-5)
    small = x[0, :4]
    assert torch.equal(layer(small)[1:2], layer(small[1:2]))
    # quantization error within half a step of each group's scale (q4_0: a whole one, as +max clips to 7 steps)
    step = {"q8_0": 1 / 127, "int8": 1 / 127, "q4_0": 2 / 8, "q4_1": 1 / 15}[fmt]
    scale = w.reshape(37, 3, 32).abs().amax(-1, keepdim=True) * (2 if fmt == "q4_1" else 1)
    if fmt == "int8":
        scale = w.abs().amax(-1)[:, None, None].expand(37, 3, 1)
    err = (ref - w).reshape(37, 3, 32).abs()
    assert (err <= scale * step * 0.5 * 1.01 + 1e-3).all(), fmt


def test_bad_shapes_and_formats():
    with pytest.raises(ValueError, match=r"multiple of the quantization group size 32.*'int8'.*'q4_1'"):
        QuantLinear.from_weight(torch.randn(4, 40), None, "int8")
    with pytest.raises(ValueError, match="quantization must be one of.*'int4'.*got 'int3'"):
        QuantLinear.from_weight(torch.randn(4, 64), None, "int3")
    with pytest.raises(ValueError, match="format must be one of"):
        QuantLinear(64, 4, "q6_k", torch.zeros(4, 10, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"qweight must be uint8 of shape \(4, 40\)"):
        QuantLinear(64, 4, "q4_1", torch.zeros(4, 41, dtype=torch.uint8))
    layer, _ = _case("q4_0")
    with pytest.raises(ValueError, match=r"expected input \[\.\.\., 96\]"):
        layer(torch.randn(2, 95))


def test_torch_fallback_warns_once(monkeypatch, caplog):
    """Without the C library every call dequantizes in torch: the same numbers, one warning."""
    layer, _ = _case("q4_1")
    x = torch.randn(3, 96)
    want = F.linear(x, _reference_weight(layer), layer.bias)
    monkeypatch.setattr(ql.QUANT_GEMM, "_lib", None)
    monkeypatch.setattr(ql.QUANT_GEMM, "_tried", True)
    monkeypatch.setattr(ql.QUANT_GEMM, "why", "no compiler (test)")
    monkeypatch.setattr(ql, "_warned", set())
    ql.probes.reset("linear.quant")
    try:
        with caplog.at_level(logging.WARNING, logger="hf_paged.model.layers.quant_linear"):
            for _ in range(3):
                torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    finally:
        ql.probes.reset("linear.quant")  # the real library probes again afterwards
    assert sum("dequantize in torch" in r.message and "no compiler (test)" in r.message for r in caplog.records) == 1


def test_int4_is_q4_1_groups_and_bf16_inputs():
    layer, w = _case("int4")
    assert layer.fmt == "q4_1" and layer.nbytes == 37 * 3 * 20
    x = torch.randn(2, 96).bfloat16()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x.float(), layer.dequantize(), layer.bias), atol=0.1, rtol=0.02)
