"""The quantized linear kernels' batch paths and modes, each against a dequantize-then-``F.linear`` reference:
the float-activation tiled path (batches above 16 rows) and the int8-activation mode (``csrc/quant_q8.c``: AMX
tiles above 16 rows where the host has AMX-INT8), in the host build and in builds beside it: without AMX, and
AVX2 only (the int8 one also without VNNI: the VPMADDUBSW path)."""

import pytest
import torch
import torch.nn.functional as F

from hf_paged.cpu import quant_linear as ql
from hf_paged.cpu.quant_linear import FORMATS, QuantLinear, dequantize_torch, quantize_activations

FLOAT_LIBS = {"host": ql.QUANT_GEMM, "avx2": ql.QUANT_GEMM_AVX2}
Q8_LIBS = {"host": ql.QUANT_Q8, "no_amx": ql.QUANT_Q8_NO_AMX, "avx2": ql.QUANT_Q8_AVX2}


def _load(libs, name):
    lib = libs[name].load()
    if lib is None:
        pytest.skip(f"{name} build failed: {libs[name].why}")
    return lib


def _case(fmt, n=37, k=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = QuantLinear.from_weight(torch.randn(n, k, generator=g), torch.randn(n, generator=g), fmt)
    return layer, dequantize_torch(layer.qweight, fmt, layer.scales, k).double()


@pytest.mark.parametrize("lib", FLOAT_LIBS)
@pytest.mark.parametrize("rows", [16, 17, 40, 71])
@pytest.mark.parametrize("fmt", FORMATS)
def test_float_tiled_path_equals_dequantize_then_linear(fmt, rows, lib):
    """Above 16 rows the float kernel dequantizes tiles of 16 weight rows (37: two whole tiles and a partial one)
    and runs every x row against them; 16 rows is the last batch of the direct path."""
    native = _load(FLOAT_LIBS, lib)
    layer, ref = _case(fmt, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows + 1))
    got = layer._call(native.hfq_linear, x)
    torch.testing.assert_close(got.double(), F.linear(x.double(), ref, layer.bias.double()), atol=1e-4, rtol=1e-5)
    # strided input rows (the program's buffers are wider than K)
    wide = torch.randn(rows, 128)
    wide[:, :96] = x
    torch.testing.assert_close(layer._call(native.hfq_linear, wide[:, :96]), got, atol=1e-5, rtol=1e-6)


def test_activation_rounding_is_the_kernels():
    """hfq8_quantize's q and d are quantize_activations' bitwise (ties, zeros and a zero block included)."""
    native = _load(Q8_LIBS, "host")
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)) * 3
    x[0, :32] = 0.0
    x[1, 32:64] = torch.tensor([127.0, 0.5, -0.5, 1.5, 2.5] + [0.25] * 27)  # d = 1: ties to even
    q = torch.empty(3, 96, dtype=torch.int8)
    d, s = torch.empty(3, 3), torch.empty(3, 3)
    assert native.hfq8_quantize(x.data_ptr(), 96, 3, 96, q.data_ptr(), d.data_ptr(), s.data_ptr(), 1) == 0
    got = (q.float().view(3, 3, 32) * d[..., None]).view(3, 96)
    assert torch.equal(got, quantize_activations(x))
    assert q[1, 32:37].tolist() == [127, 0, 0, 2, 2]
    torch.testing.assert_close(s, d * q.float().view(3, 3, 32).sum(-1))


@pytest.mark.parametrize("lib", Q8_LIBS)
@pytest.mark.parametrize("rows", [1, 3, 5, 16, 17, 40])
@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_activations_equal_rounded_x_times_dequantized_w(fmt, rows, lib):
    """The int8-activation kernel computes exactly quantize_activations(x) @ dequant(W)^T (+ bias), up to fp32
    rounding of the per-block scaled integer sums; and far from x @ dequant(W)^T where the rounding matters."""
    native = _load(Q8_LIBS, lib)
    if lib != "host":
        assert native.hfq8_has_simd() == 1 and native.hfq8_amx() == 0  # above 16 rows: the vector path
    layer, ref = _case(fmt, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows + 2))
    got = layer._call(native.hfq8_linear, x).double()
    want = F.linear(quantize_activations(x).double(), ref, layer.bias.double())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    exact = F.linear(x.double(), ref, layer.bias.double())
    assert (got - exact).abs().max() > 1e-3  # the mode really rounds x (a test that can tell the modes apart)


def test_int8_mode_rows_do_not_depend_on_the_batch_and_forward_uses_it():
    native = _load(Q8_LIBS, "host")
    layer, ref = _case("q4_1", n=45, k=128)
    layer.activations = "int8"
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(3))
    full = layer(x)
    assert torch.equal(full, layer._call(native.hfq8_linear, x))
    for i in (0, 4, 8):
        assert torch.equal(full[i : i + 1], layer(x[i : i + 1]))
    assert torch.equal(full[2:7], layer(x[2:7]))
    big = torch.randn(40, 128, generator=torch.Generator().manual_seed(5))  # above 16 rows (AMX tiles where present)
    assert torch.equal(layer(big)[20:], layer(big[20:]))
    assert torch.equal(layer(big)[3:25], layer(big[3:25]))


def test_int8_mode_without_its_library_uses_float_kernel_or_torch(monkeypatch):
    """No int8 build: the float kernel serves (exact numbers); no build at all: torch rounds x the same way."""
    layer, ref = _case("q8_0")
    layer.activations = "int8"
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(ql, "native_library", lambda activations="float": None if activations == "int8" else ql.QUANT_GEMM.load())
    torch.testing.assert_close(layer(x).double(), F.linear(x.double(), ref, layer.bias.double()), atol=1e-4, rtol=1e-5)
    monkeypatch.setattr(ql, "native_library", lambda activations="float": None)
    want = F.linear(quantize_activations(x).double(), ref, layer.bias.double())
    torch.testing.assert_close(layer(x).double(), want, atol=1e-4, rtol=1e-5)


def test_bad_activation_mode():
    with pytest.raises(ValueError, match=r"activations must be one of \('float', 'int8'\), got 'int4'"):
        QuantLinear.from_weight(torch.randn(4, 64), None, "q8_0", activations="int4")
