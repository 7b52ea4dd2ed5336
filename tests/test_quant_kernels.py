"""The quantized linear kernels' batch paths and modes, each against a dequantize-then-``F.linear`` reference:
the float-activation tiled path (batches above 16 rows), the int8-activation mode (``csrc/quant_q8.c``: AMX
tiles above 16 rows where the host has AMX-INT8), in the host build and in builds beside it: without AMX, and
AVX2 only (the int8 one also without VNNI: the VPMADDUBSW path); and the bf16-activation mode
(``csrc/quant_bf16.c``, AMX-BF16 only) with its fallback to the float kernel where the CPU has no AMX-BF16."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_paged.model.layers import quant_layout
from hf_paged.model.layers import quant_linear as ql
from hf_paged.model.layers.quant_linear import FORMATS, QuantLinear, dequantize_torch, quantize_activations, round_bf16

FLOAT_LIBS = {"host": ql.QUANT_GEMM, "avx2": ql.QUANT_GEMM_AVX2}
Q8_LIBS = {"host": ql.QUANT_Q8, "no_amx": ql.QUANT_Q8_NO_AMX, "avx2": ql.QUANT_Q8_AVX2}
BF16_LIBS = {"host": ql.QUANT_BF16, "no_amx": ql.QUANT_BF16_NO_AMX}


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


@pytest.mark.parametrize("lib", Q8_LIBS)
def test_activation_rounding_is_the_kernels(lib):
    """hfq8_quantize's q and d are quantize_activations' bitwise (ties, zeros and a zero block included), in
    every build (the AVX2 one rounds 8 lanes at a time), also on rows of blocks whose scales span many orders of
    magnitude and strided rows."""
    native = _load(Q8_LIBS, lib)
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
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(7, 1600, generator=g) * torch.logspace(-6, 6, 7 * 50).view(7, 50, 1).repeat(1, 1, 32).view(7, 1600)
    rows = wide[:, :1536]  # row stride 1600
    q = torch.empty(7, 1536, dtype=torch.int8)
    d, s = torch.empty(7, 48), torch.empty(7, 48)
    assert native.hfq8_quantize(rows.data_ptr(), 1600, 7, 1536, q.data_ptr(), d.data_ptr(), s.data_ptr(), 2) == 0
    assert torch.equal((q.float().view(7, 48, 32) * d[..., None]).view(7, 1536), quantize_activations(rows))
    assert torch.equal(s, d * q.float().view(7, 48, 32).sum(-1))  # the integer sum, scaled once


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
    fn, mode, weight = layer.kernel()  # hfq8_linear, or the rows8 kernel where this host picked it
    assert mode == "int8" and fn in (native.hfq8_linear, native.hfq8i_linear)
    assert torch.equal(full, layer._call(fn, x, weight=weight))
    for i in (0, 4, 8):
        assert torch.equal(full[i : i + 1], layer(x[i : i + 1]))
    assert torch.equal(full[2:7], layer(x[2:7]))
    big = torch.randn(40, 128, generator=torch.Generator().manual_seed(5))  # above 16 rows (AMX tiles where present)
    assert torch.equal(layer(big)[20:], layer(big[20:]))
    assert torch.equal(layer(big)[3:25], layer(big[3:25]))
    assert torch.equal(layer(big)[5:9], layer(big[5:9]))  # across the AMX threshold: 40 rows against 4


@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_kernels_give_a_row_the_same_bits_in_every_build_and_batch(fmt):
    """The block kernel (its vector path up to 16 rows, AMX tiles above where the host has them), the rows8 kernel
    (VNNI or VPMADDUBSW sums, AMX above 16 rows from its own copy) and every build (host, without AMX, AVX2 only)
    compute each output by the same operations in the same order: a row's result is one set of bits whichever
    kernel, build and batch size serve it. (AMX hosts once gave a row other bits at 17 rows and more.)"""
    layer, ref = _case(fmt, n=45, k=160, seed=11)
    x = torch.randn(40, 160, generator=torch.Generator().manual_seed(12))
    want = None
    for lib in Q8_LIBS:
        native = _load(Q8_LIBS, lib)
        kernels = [(native.hfq8_linear, None)]
        if native.hfq8i_available():
            kernels.append((native.hfq8i_linear, _rows8(native, layer)))
        for fn, weight in kernels:
            full = layer._call(fn, x, weight=weight)
            if want is None:
                want = full
                torch.testing.assert_close(full.double(), F.linear(quantize_activations(x).double(), ref,
                                                                   layer.bias.double()), atol=1e-4, rtol=1e-5)
            assert torch.equal(full, want), (lib, fn)
            for rows in (1, 5, 16, 17):
                assert torch.equal(layer._call(fn, x[:rows], weight=weight), want[:rows]), (lib, fn, rows)
            assert torch.equal(layer._call(fn, x[19:40], weight=weight), want[19:40]), (lib, fn)


def _rows8(native, layer):
    copy = torch.empty(native.hfq8i_bytes(FORMATS[layer.fmt], layer.out_features, layer.in_features),
                       dtype=torch.uint8)
    assert native.hfq8i_repack(layer.qweight.data_ptr(), FORMATS[layer.fmt], layer.out_features,
                               layer.in_features, copy.data_ptr(), 2) == 0
    return copy


@pytest.mark.parametrize("lib", Q8_LIBS)
@pytest.mark.parametrize("n", [37, 64])
@pytest.mark.parametrize("fmt", FORMATS)
def test_rows8_kernel_equals_rounded_x_times_dequantized_w_for_every_batch(fmt, n, lib):
    """The interleaved int8 kernel (``csrc/quant_q8_rows8.h``: int16 sums for the 4-bit formats, signed
    VPMADDUBSW pairs for Q8_0 and int8 with its row scales) computes quantize_activations(x) @ dequant(W)^T
    (+ bias) up to fp32 rounding, for every row tail of its 4-row tiles and a last group of fewer than 8 output
    rows (37); and each row's result is the same whatever rows share its batch (below 8 rows each quad of
    activations is broadcast from the rounded rows, from 8 rows read from the tile's expanded copy: the same
    numbers)."""
    native = _load(Q8_LIBS, lib)
    if not native.hfq8i_available():
        pytest.skip("build without AVX2")
    layer, ref = _case(fmt, n=n, seed=n)
    copy = _rows8(native, layer)
    assert native.hfq8i_bytes(FORMATS[fmt], n, 95) == -1  # K must be a multiple of 32
    if fmt != "int8":  # fp16 scales: the copy of a default-model-wide weight is the GGUF bytes, no more
        assert native.hfq8i_bytes(FORMATS[fmt], 64, 576) == 64 * 576 // 32 * ql.BLOCK_BYTES[fmt]
    x = torch.randn(71, 96, generator=torch.Generator().manual_seed(7))
    full = layer._call(native.hfq8i_linear, x, weight=copy)
    want = F.linear(quantize_activations(x).double(), ref, layer.bias.double())
    torch.testing.assert_close(full.double(), want, atol=1e-4, rtol=1e-5)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 40):
        assert torch.equal(full[:rows], layer._call(native.hfq8i_linear, x[:rows], weight=copy))
    assert torch.equal(full[6:9], layer._call(native.hfq8i_linear, x[6:9], weight=copy))
    scales = None if layer.scales is None else torch.cat([layer.scales, layer.scales])
    grouped = QuantLinear(96, 2 * n, layer.fmt, torch.cat([layer.qweight, layer.qweight]), scales,
                          torch.cat([layer.bias, layer.bias]).detach(), "int8")  # as the program's q/k/v groups
    both = grouped._call(native.hfq8i_linear, x, weight=_rows8(native, grouped))
    assert torch.equal(both[:, :n], full) and torch.equal(both[:, n:], full)


@pytest.mark.parametrize("lib", Q8_LIBS)
@pytest.mark.parametrize("k", [96, 800])
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_rows8_kernel_walks_chunks_of_groups_and_any_k_alike(fmt, k, lib):
    """A batch walks each thread's share of the 8-row groups in chunks of 32 (33 groups: a chunk and one more,
    split over 1 and 2 threads); K = 800 is past the size whose 4-row tile is expanded (the quads are broadcast
    at every batch there). Every row as in a one-row call, the whole as the rounded x times the dequantized W."""
    native = _load(Q8_LIBS, lib)
    if not native.hfq8i_available():
        pytest.skip("build without AVX2")
    layer, ref = _case(fmt, n=33 * 8 - 3, k=k, seed=k)
    copy = _rows8(native, layer)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(k + 1))
    full = layer._call(native.hfq8i_linear, x, weight=copy)
    want = F.linear(quantize_activations(x).double(), ref, layer.bias.double())
    torch.testing.assert_close(full.double(), want, atol=1e-4, rtol=1e-5)
    for i in (0, 5, 12):
        assert torch.equal(full[i : i + 1], layer._call(native.hfq8i_linear, x[i : i + 1], weight=copy))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(full, layer._call(native.hfq8i_linear, x, weight=copy))
    finally:
        torch.set_num_threads(threads)


def test_layer_picks_one_int8_kernel_for_every_batch_and_follows_weight_changes(monkeypatch):
    """HF_PAGED_Q8_LAYOUT forces the int8 kernel of Q4 weights; the interleaved copy is made again after the
    weight changes in place (``load_state_dict``)."""
    native = _load(Q8_LIBS, "host")
    if not native.hfq8i_available():
        pytest.skip("build without AVX2")
    layer, _ = _case("q4_1", n=40, k=96)
    layer.activations = "int8"
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(4))
    got = {}
    for layout in ("rows8", "blocks"):
        monkeypatch.setenv(quant_layout.ROWS8_ENV, layout)
        monkeypatch.setattr(quant_layout, "_chosen", {})
        fn, _, weight = layer.kernel()
        assert fn == (native.hfq8i_linear if layout == "rows8" else native.hfq8_linear)
        assert weight is (layer.qweight if layout == "blocks" else quant_layout.rows8_copy(layer, native))
        got[layout] = layer(x)
        assert torch.equal(got[layout][2:3], layer(x[2:3]))
    assert torch.equal(got["rows8"], got["blocks"])  # the same operations per output
    monkeypatch.setenv(quant_layout.ROWS8_ENV, "rows8")
    monkeypatch.setattr(quant_layout, "_chosen", {})
    before = layer(x)
    other, _ = _case("q4_1", n=40, k=96, seed=5)
    with torch.no_grad():
        layer.qweight.copy_(other.qweight)  # in place, as load_state_dict does
        layer.bias.copy_(other.bias)
    other.activations = "int8"
    assert torch.equal(layer(x), other(x))
    assert not torch.equal(layer(x), before)
    monkeypatch.setenv(quant_layout.ROWS8_ENV, "fastest")
    monkeypatch.setattr(quant_layout, "_chosen", {})
    with pytest.raises(ValueError, match="HF_PAGED_Q8_LAYOUT must be 'rows8' or 'blocks'"):
        layer(x)


@pytest.mark.parametrize("faster", ["rows8", "blocks"])
def test_int8_kernel_choice_follows_the_timings(monkeypatch, faster):
    """Unforced, each weight family takes the kernel its timing found faster (here: timings as the store would
    give them), once per process: the 4-bit formats as one family, Q8_0 and the int8 format each as their own."""
    native = _load(Q8_LIBS, "host")
    if not native.hfq8i_available():
        pytest.skip("build without AVX2")
    from hf_paged.kernels.cpu import tuning_store

    monkeypatch.delenv(quant_layout.ROWS8_ENV, raising=False)
    monkeypatch.setattr(quant_layout, "_chosen", {})
    asked = []
    slow, fast = 2e-4, 1e-4
    fake = {"rows8": fast if faster == "rows8" else slow, "blocks": fast if faster == "blocks" else slow}
    monkeypatch.setattr(tuning_store, "get", lambda key: asked.append(key) or dict(fake))
    assert quant_layout.rows8_chosen("q4_0", native) is (faster == "rows8")
    assert quant_layout.rows8_chosen("q4_1", native) is (faster == "rows8")  # the same family: not timed again
    assert quant_layout.rows8_chosen("int8", native) is (faster == "rows8")
    stem = Path(native._name).stem
    assert asked == [f"q8-layout:q4_1:960x576:{stem}", f"q8-layout:int8:960x576:{stem}"]  # again for a new build


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


def _amx_bf16():
    lib = _load(BF16_LIBS, "host")
    if not lib.hfqb_available():
        pytest.skip("this CPU (or its OS) has no AMX-BF16: the bf16 mode runs the float kernel (tested below)")
    return lib


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 64, 71])
@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_activations_equal_rounded_x_times_rounded_w(fmt, rows):
    """The bf16 kernel computes bf16(x) @ bf16(dequant(W))^T (+ bias) with fp32 sums, every batch size on AMX tiles
    (37 weight rows: two whole tiles and a partial one; 71 x rows: a pass of 64 and one of 7); strided input rows;
    no bias; and far from x @ dequant(W)^T, so it cannot silently be the float kernel."""
    native = _amx_bf16()
    layer, ref = _case(fmt, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows + 3))
    got = layer._call(native.hfqb_linear, x).double()
    want = F.linear(round_bf16(x).double(), round_bf16(ref.float()).double(), layer.bias.double())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert (got - F.linear(x.double(), ref, layer.bias.double())).abs().max() > 1e-3
    wide = torch.randn(rows, 128)
    wide[:, :96] = x
    assert torch.equal(layer._call(native.hfqb_linear, wide[:, :96]).double(), got)
    layer.bias = None
    torch.testing.assert_close(layer._call(native.hfqb_linear, x).double(),
                               F.linear(round_bf16(x).double(), round_bf16(ref.float()).double()), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_in_and_out_is_the_fp32_entry_rounded(fmt):
    """A bf16 model's activations go in as bf16 and come out rounded to bf16: bitwise what converting x to fp32,
    running the fp32 entry and rounding its output gives (strided rows too); forward takes that entry for bf16 x."""
    native = _amx_bf16()
    layer, _ = _case(fmt, seed=11)
    for rows in (1, 17, 64, 70):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = layer._call(native.hfqb_linear_bf16, x, io=torch.bfloat16)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, layer._call(native.hfqb_linear, x.float()).bfloat16())
        wide = torch.zeros(rows, 160, dtype=torch.bfloat16)
        wide[:, :96] = x
        assert torch.equal(layer._call(native.hfqb_linear_bf16, wide[:, :96], io=torch.bfloat16), got)
    layer.activations = "bf16"
    assert ql.kernel("bf16")[1] == "bf16"  # probed already: the calls below are forward's own
    calls = []
    real = native.hfqb_linear_bf16
    try:
        native.hfqb_linear_bf16 = lambda *a: calls.append(1) or real(*a)
        assert torch.equal(layer(x), got)
    finally:
        native.hfqb_linear_bf16 = real
    assert calls == [1]


def test_bf16_mode_rows_do_not_depend_on_the_batch_and_forward_uses_it():
    native = _amx_bf16()
    layer, ref = _case("q4_0", n=45, k=128)
    layer.activations = "bf16"
    assert ql.kernel("bf16") == (native.hfqb_linear, "bf16")
    x = torch.randn(100, 128, generator=torch.Generator().manual_seed(6))
    full = layer(x)
    assert torch.equal(full, layer._call(native.hfqb_linear, x))
    for lo, hi in ((0, 1), (7, 8), (2, 19), (30, 100), (99, 100)):
        assert torch.equal(full[lo:hi], layer(x[lo:hi]))


def test_bf16_build_without_amx_says_so_and_the_mode_falls_back_to_float(monkeypatch, caplog):
    """A build without AMX-BF16 (an AVX2 or AVX-512-only CPU) reports it and refuses to compute (-3); the probe
    fails with the reason, and layers in bf16 mode run the exact float kernel, warned once; with no kernel at all,
    torch rounds x and W to bf16 as the kernel does."""
    native = _load(BF16_LIBS, "no_amx")
    assert native.hfqb_available() == 0
    layer, ref = _case("q8_0")
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(4))
    y = torch.empty(4, 37)
    assert native.hfqb_linear(x.data_ptr(), 96, layer.qweight.data_ptr(), FORMATS["q8_0"], None, None, y.data_ptr(),
                              37, 4, 37, 96, 1) == -3
    monkeypatch.setattr(ql, "QUANT_BF16", ql.QUANT_BF16_NO_AMX)
    monkeypatch.setitem(ql._PATHS, "bf16", ("linear.quant_bf16", ql.QUANT_BF16_NO_AMX))
    monkeypatch.setattr(ql, "_warned", set())
    ql.probes.reset("linear.quant_bf16")
    try:
        with caplog.at_level("WARNING", logger="hf_paged.model.layers.quant_linear"):
            fn, mode = ql.kernel("bf16")
            ql.kernel("bf16")
        assert mode == "float" and fn == ql.QUANT_GEMM.load().hfq_linear
        warned = [r.getMessage() for r in caplog.records if "bf16 activations" in r.getMessage()]
        assert len(warned) == 1 and "no AMX-BF16" in warned[0], warned
        layer.activations = "bf16"
        torch.testing.assert_close(layer(x).double(), F.linear(x.double(), ref, layer.bias.double()), atol=1e-4,
                                   rtol=1e-5)
    finally:
        ql.probes.reset("linear.quant_bf16")
    monkeypatch.setattr(ql, "native_library", lambda activations="float": None)
    want = F.linear(round_bf16(x).double(), round_bf16(ref.float()).double(), layer.bias.double())
    torch.testing.assert_close(layer(x).double(), want, atol=1e-4, rtol=1e-5)


def test_bad_activation_mode():
    with pytest.raises(ValueError, match=r"activations must be one of \('float', 'int8', 'bf16'\), got 'int4'"):
        QuantLinear.from_weight(torch.randn(4, 64), None, "q8_0", activations="int4")
