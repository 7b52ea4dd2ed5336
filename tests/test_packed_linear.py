"""Pre-packed linear layers (MKL fp32, oneDNN fp32/bf16, our native fp32 GEMM): F.linear's results, used only
inside engine forwards."""

import platform

import pytest
import torch
import torch.nn.functional as F

from hf_paged.attention.function import engine_forward
from hf_paged.kernels.cpu import native_gemm
from hf_paged.kernels.cpu import packed_linear
from hf_paged.kernels.cpu.native import NativeLibrary
from hf_paged.kernels.cpu.packed_linear import NativePackedWeight, OneDnnPackedWeight, PackedWeight, UpcastPackedWeight
from hf_paged.model.layers.packed import PackedLinears
from hf_paged.model.layers.linear import DenseLinear, OwnedLinears

needs_mkl = pytest.mark.skipif(not packed_linear.available("mkl"), reason="torch without MKL's packed sgemm")
needs_onednn = pytest.mark.skipif(not packed_linear.available("onednn"), reason="torch without oneDNN")
needs_native = pytest.mark.skipif(not packed_linear.available("native"), reason="native GEMM not built here")


def _native_case(rows, out_features, in_features, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    return w, b, x


@needs_native
@pytest.mark.parametrize("rows", [1, 5, 7, 64, 97, 300])
@pytest.mark.parametrize("shape", [(96, 80), (97, 600), (3, 5)], ids=["even", "ragged", "tiny"])
def test_native_packed_linear_matches_linear(rows, shape):
    """Every row-block tail (rows % 6), a last panel narrower than the vector width, K past one K-block (600: three equal blocks of 200),
    more rows than one block (97, 300: prefill's row blocks), with and without bias, 3-d and strided inputs."""
    w, b, x = _native_case(rows, *shape, seed=rows)
    pack = NativePackedWeight(w)
    want = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(pack.linear(x, b).double(), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(pack.linear(x, None), F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert pack.linear(x.view(1, rows, -1), b).shape == (1, rows, shape[0])
    wide = torch.cat([x, torch.randn_like(x)], dim=1)[:, : shape[1]]  # rows further apart than K
    assert wide.stride(0) == 2 * shape[1]
    assert torch.equal(pack.linear(wide, b), pack.linear(x, b))
    assert pack.linear(x[:0], b).shape == (0, shape[0])


@needs_native
def test_native_packed_linear_rows_do_not_depend_on_the_batch():
    """A row's output is bitwise the same alone, in a decode-sized batch and in a prefill-sized one."""
    w, b, x = _native_case(300, 200, 300, seed=7)
    pack = NativePackedWeight(w)
    full = pack.linear(x, b)
    for lo, hi in ((0, 1), (5, 11), (0, 64), (250, 300)):
        assert torch.equal(pack.linear(x[lo:hi], b), full[lo:hi]), (lo, hi)


@needs_native
def test_native_packed_linear_follows_weight_changes_and_empty_inputs():
    w, b, x = _native_case(4, 16, 8, seed=1)
    pack = NativePackedWeight(w)
    assert not pack.stale(w)
    w.mul_(2)
    assert pack.stale(w)
    empty = NativePackedWeight(torch.empty(5, 0))
    assert torch.equal(empty.linear(torch.empty(3, 0), torch.arange(5.0)), torch.arange(5.0).expand(3, 5))


def _panels(w: torch.Tensor, nr: int, pair: int = 1) -> torch.Tensor:
    """The panel layout in torch: out[p][k][j] = w[p * nr + j][k] (bf16: k counts pairs), zero rows past N."""
    n, k = w.shape
    padded = torch.zeros(-(-n // nr) * nr, k, dtype=w.dtype)
    padded[:n] = w
    if pair == 1:
        return padded.view(-1, nr, k).transpose(1, 2).contiguous().flatten()
    return padded.view(-1, nr, k // 2, 2).permute(0, 2, 1, 3).contiguous().flatten()


@needs_native
@pytest.mark.parametrize("shape", [(7, 5), (33, 64), (100, 37), (64, 600)])
def test_native_pack_layout(shape):
    """The packed bytes are the panel layout exactly: ragged last panels, K not a multiple of the packing's
    k-blocks, rows further apart than K; bf16 (pairs of k, an odd K padded) from aligned and odd-aligned rows."""
    lib = native_gemm.NATIVE_GEMM.load()
    w = torch.randn(*shape)
    assert torch.equal(NativePackedWeight(w).packed, _panels(w, lib.hfp_gemm_nr()))
    wide = torch.randn(shape[0], shape[1] + 3)[:, 1 : shape[1] + 1]
    assert torch.equal(NativePackedWeight(wide).packed, _panels(wide.contiguous(), lib.hfp_gemm_nr()))
    if not lib.hfp_gemm_bf16_ok():
        return
    nr, k = lib.hfp_gemm_bf16_nr(), shape[1] + shape[1] % 2
    wb = torch.randn(*shape).bfloat16()
    want = _panels(F.pad(wb, (0, k - shape[1])), nr, pair=2)
    assert torch.equal(NativePackedWeight(wb).packed.view(torch.int16), want.view(torch.int16))
    odd = torch.randn(shape[0] * k + 1).bfloat16()[1:].view(shape[0], k)  # rows at 2-byte, not 4-byte, addresses
    out = torch.empty(-(-shape[0] // nr) * nr * k, dtype=torch.bfloat16)
    lib.hfp_gemm_bf16_pack(odd.data_ptr(), k, shape[0], k, out.data_ptr())
    assert torch.equal(out.view(torch.int16), _panels(odd.contiguous(), nr, pair=2).view(torch.int16))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_stacked_pack_is_the_pack_of_the_concatenation(dtype):
    """q/k/v and gate/up packed member by member (no concatenated copy) give the concatenation's pack, byte for
    byte; members whose rows would share a panel are left to the concatenation (None)."""
    if dtype == torch.bfloat16 and not packed_linear.available("native", dtype):
        pytest.skip("native bf16 GEMM needs AVX-512 BF16")
    lib = native_gemm.NATIVE_GEMM.load()
    nr = lib.hfp_gemm_nr() if dtype == torch.float32 else lib.hfp_gemm_bf16_nr()
    ws = [torch.randn(4 * nr, 40, dtype=dtype), torch.randn(nr, 40, dtype=dtype), torch.randn(nr + 3, 40, dtype=dtype)]
    stacked, whole = NativePackedWeight.stacked(ws), NativePackedWeight(torch.cat(ws))
    assert torch.equal(stacked.packed.view(torch.int16), whole.packed.view(torch.int16))
    assert (stacked.out_features, stacked.in_features) == (whole.out_features, whole.in_features)
    x = torch.randn(5, 40, dtype=dtype)
    assert torch.equal(stacked.linear(x, None), whole.linear(x, None))
    assert stacked.stale(ws[0]) and stacked.source is None  # its group watches the members' weights
    assert NativePackedWeight.stacked([torch.randn(nr + 1, 40, dtype=dtype), torch.randn(nr, 40, dtype=dtype)]) is None
    assert NativePackedWeight.stacked([ws[0], torch.randn(nr, 41, dtype=dtype)]) is None  # other widths


needs_native_bf16 = pytest.mark.skipif(not packed_linear.available("native", torch.bfloat16),
                                       reason="native bf16 GEMM needs AVX-512 BF16")


@needs_native_bf16
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 16, 17, 64, 97, 300])
@pytest.mark.parametrize("shape", [(96, 80), (97, 600), (3, 5), (40, 1536)], ids=["even", "ragged", "odd-k", "long-k"])
def test_native_bf16_packed_linear_matches_linear(rows, shape):
    """bf16 (AMX tiles where the CPU and OS have them, else VDPBF16PS): row-block tails (rows % 8, rows % 16), a
    last panel narrower than its 48 columns (masked stores), K past a multiple of 32 (AMX's even tail), an odd K
    (zero column), prefill's row blocks (97, 300), bias in fp32; equal to F.linear but for the last bit of a
    few sums (another order), rows independent of the batch, strided inputs."""
    w, b, x = (t.bfloat16() for t in _native_case(rows, *shape, seed=rows))
    pack = NativePackedWeight(w)
    got = pack.linear(x, b)
    want = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(got.double(), want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)
    assert (got == F.linear(x, w, b)).float().mean() > 0.99
    assert torch.equal(pack.linear(x[rows // 2 : rows // 2 + 1], b), got[rows // 2 : rows // 2 + 1])
    wide = torch.cat([x, x], dim=1)[:, : shape[1]]
    assert torch.equal(pack.linear(wide, b), got)
    assert torch.equal(pack.linear(x, None), pack.linear(x, torch.zeros_like(b)))
    nan = x.clone()
    nan[0, 0] = float("nan")
    assert pack.linear(nan, b)[0].isnan().all() and not pack.linear(nan, b)[1:].isnan().any()


@needs_native_bf16
def test_native_bf16_gemm_without_amx_agrees():
    """The VDPBF16PS kernel, built without AMX (what AVX-512 BF16 CPUs without tiles, e.g. Zen 4/5, run), reports
    no AMX and agrees with the default build (AMX on an AMX host) to the last bit of a few sums."""
    flags = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
    lib = NativeLibrary("gemm_cpu.c", native_gemm.NATIVE_GEMM.functions, extra_flags=flags).load()
    if lib is None:
        pytest.skip("the compiler does not know -mno-amx-*")
    assert lib.hfp_gemm_bf16_ok() and lib.hfp_gemm_bf16_amx() == 0
    default = native_gemm.NATIVE_GEMM.load()
    for rows, (n, k) in ((1, (97, 600)), (17, (96, 80)), (70, (50, 1536))):
        w, b, x = (t.bfloat16() for t in _native_case(rows, n, k, seed=rows))
        bias = b.float()
        packed = torch.empty(NativePackedWeight(w).packed.shape, dtype=torch.bfloat16)
        lib.hfp_gemm_bf16_pack(w.data_ptr(), w.stride(0), n, k, packed.data_ptr())
        assert torch.equal(packed, NativePackedWeight(w).packed)  # one layout for both kernels
        got = torch.empty(rows, n, dtype=torch.bfloat16)
        assert lib.hfp_gemm_bf16(x.data_ptr(), x.stride(0), packed.data_ptr(), bias.data_ptr(), got.data_ptr(),
                                 got.stride(0), rows, n, k, torch.get_num_threads()) == 0
        ref = torch.empty_like(got)
        assert default.hfp_gemm_bf16(x.data_ptr(), x.stride(0), packed.data_ptr(), bias.data_ptr(),
                                     ref.data_ptr(), ref.stride(0), rows, n, k, torch.get_num_threads()) == 0
        assert (got == ref).float().mean() > 0.99
        torch.testing.assert_close(got.double(), ref.double(), atol=2e-2 * ref.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize(("isa_flags", "panel"), [
    (("-mno-avx512f",), 16), (("-mno-avx512f", "-mno-avx2", "-mno-fma"), 16), (("-mno-avx512f", "-mno-avx"), 8),
], ids=["avx2", "avx-no-fma", "sse"])
def test_native_gemm_narrower_vector_paths(isa_flags, panel, monkeypatch):
    """The GEMM's panel width follows the ISA it is built for (32 columns with AVX-512, 16 with AVX, 8 with
    SSE): build the narrower ones too, so an AVX-512 host also checks what AVX2-only CPUs run."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX") or platform.machine() != "x86_64":
        pytest.skip("x86 ISA flags")
    lib = NativeLibrary("gemm_cpu.c", native_gemm.NATIVE_GEMM.functions, extra_flags=isa_flags)
    assert lib.load() is not None, lib.why
    assert lib.load().hfp_gemm_nr() == panel
    monkeypatch.setattr(native_gemm, "NATIVE_GEMM", lib)
    assert not lib.load().hfp_gemm_bf16_ok()  # no AVX-512: no bf16 GEMM (its probe fails, oneDNN or upcast serve)
    for rows, shape in ((1, (97, 600)), (13, (40, 70)), (130, (33, 20))):
        w, b, x = _native_case(rows, *shape, seed=rows)
        got = NativePackedWeight(w).linear(x, b)
        torch.testing.assert_close(got.double(), F.linear(x.double(), w.double(), b.double()), atol=1e-4, rtol=1e-5)


@needs_mkl
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_matmul_matches_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g)
    x = torch.randn(rows, 80, generator=g)
    got = PackedWeight(w).matmul(x)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)
    if rows >= 64:
        assert torch.equal(got, F.linear(x, w))  # the same MKL kernel, without the per-call packing


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_packed_linear_matches_linear_where_its_probe_passes(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 80, generator=g).to(dtype)
    if not packed_linear.available("onednn", dtype):
        # e.g. bf16 on a CPU without AVX-512 BW/VL/DQ: the probe says why, and packing really fails here
        reason = packed_linear.unavailable_reason("onednn", dtype)
        assert reason
        with pytest.raises(Exception):  # noqa: B017 - whatever the op raises is what the probe caught
            OneDnnPackedWeight(w).linear(x, b)
        return
    pack = OneDnnPackedWeight(w)
    got, want = pack.linear(x, b), F.linear(x, w, b)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)  # F.linear runs the same oneDNN kernel, only without the pre-packing
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert pack.linear(x.view(1, rows, 80), None).shape == (1, rows, 96)  # leading dims kept


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_packed_linear_is_linear_computed_in_fp32(rows, dtype):
    if not packed_linear.available("any", torch.float32):
        pytest.skip("no fp32 packing in this torch build")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 80, generator=g).to(dtype)
    got = UpcastPackedWeight(w).linear(x, b)
    assert got.dtype == dtype
    want = F.linear(x.float(), w.float(), b.float()).to(dtype)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=5e-2, rtol=2e-2)


def test_auto_kind_picks_a_working_packing_or_plain_linear_per_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16).bfloat16())
    OwnedLinears(model)  # the engine's linear layer objects, which packing acts on
    packs = PackedLinears(model)
    for dtype in (torch.float32, torch.bfloat16):
        kind = packs.kinds[dtype]
        assert kind == "torch" or packed_linear.available(kind, dtype), (dtype, kind)
    with pytest.raises(ValueError, match="'mkl', 'onednn', 'native' or 'upcast'"):
        PackedLinears(model, kind="blas")
    packs.remove()
    if packed_linear.available("any", torch.float32):
        packs = PackedLinears(model, kind="any")  # a packing even if F.linear is as fast
        assert packs.kinds[torch.float32] in packed_linear.CANDIDATES[torch.float32]
        packs.remove()


@pytest.mark.parametrize("kind", ["mkl", "onednn", "native"])
def test_packs_route_engine_forwards_only_and_follow_weight_changes(kind):
    if not packed_linear.available(kind):
        pytest.skip(f"torch without {kind} packing")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16, bias=False))
    x = torch.randn(70, 32)
    want = model(x).detach()
    owned = OwnedLinears(model)
    assert [type(m) for m in model] == [DenseLinear, torch.nn.ReLU, DenseLinear]
    packs = PackedLinears(model, kind)
    assert len(packs) == 2 and packs.packed_kinds == {torch.float32: kind}
    calls = []
    cls = packed_linear.PACKERS[kind]
    original = cls.linear
    cls.linear = lambda self, t, b: calls.append(1) or original(self, t, b)
    try:
        with torch.no_grad():
            plain = model(x)
            assert not calls  # no engine forward: the original Linear.forward ran
            with engine_forward():
                engine = model(x)
            assert len(calls) == 2
        assert torch.equal(plain, want)
        torch.testing.assert_close(engine, want, atol=1e-5, rtol=1e-5)
        if kind == "mkl":
            assert torch.equal(engine, want)  # the same MKL kernel, without the per-call packing
        with torch.no_grad():
            model[0].weight.mul_(2)  # in-place change: re-packed on next use
            doubled = model(x)
            with engine_forward():
                torch.testing.assert_close(model(x), doubled, atol=1e-5, rtol=1e-5)
        with engine_forward():
            y = model(x)  # autograd wanted: falls back to the original forward
        assert y.requires_grad and len(calls) == 4
    finally:
        cls.linear = original
    packs.remove()
    assert model[0].packer is None and model[0]._pack is None and len(packs) == 0
    owned.remove()
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]


@pytest.mark.parametrize("kind", ["mkl", "onednn", "native", "upcast"])
def test_layers_pack_on_first_engine_forward_even_under_inference_mode(kind):
    """Packing is lazy (the members of a packed q/k/v or gate/up group never need a pack of their own), so the
    first pack is made inside an engine step, under ``torch.inference_mode``: it must still be an ordinary tensor
    with a version counter (an ``upcast`` pack made there raised "Inference tensors do not track version
    counter")."""
    dtype = torch.bfloat16 if kind == "upcast" else torch.float32
    if not packed_linear.available(kind, dtype):
        pytest.skip(f"no {kind} packing for {dtype} here")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16)).to(dtype)
    x = torch.randn(5, 32, dtype=dtype)
    with torch.no_grad():
        want = model(x)
    owned = OwnedLinears(model)
    packs = PackedLinears(model, kind)
    assert len(packs) == 2 and all(m._pack is None for m in model)  # nothing packed before it is used
    with torch.inference_mode(), engine_forward():
        got = model(x)
    assert all(m._pack is not None for m in model)
    torch.testing.assert_close(got, want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    with torch.no_grad():
        model[0].weight.mul_(2)  # the pack made under inference_mode still sees in-place changes
        want = model(x)
    with torch.inference_mode(), engine_forward():
        torch.testing.assert_close(model(x), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    packs.remove()
    owned.remove()


def test_prepack_weights_config_is_validated():
    from hf_paged.config import EngineConfig

    for bad in ("yes", 1, 0.5, "MKL"):
        with pytest.raises(ValueError, match="prepack_weights"):
            EngineConfig(prepack_weights=bad)
    for good in (None, True, False, "mkl", "onednn", "native", "upcast"):
        assert EngineConfig(prepack_weights=good).prepack_weights == good


@pytest.mark.parametrize("kind", ["mkl", "onednn", "native"])
def test_engine_with_each_packing_keeps_greedy_parity(kind):
    if not packed_linear.available(kind):
        pytest.skip(f"torch without {kind} packing")
    from hf_paged import PagedGenerator, SamplingParams
    from tests.helpers import make_model, make_prompts, stock_greedy

    model = make_model("llama", seed=3)
    prompts = make_prompts(4, [1, 9, 40, 70], seed=3)
    engine = PagedGenerator(model, num_blocks=64, block_size=4, prepack_weights=kind)
    try:
        assert engine.packed.packed_kinds == {torch.float32: kind}
        outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        engine.close()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == stock_greedy(model, prompt, 12)
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear  # close() gave the stock modules back


@pytest.mark.parametrize("kind", ["mkl", "onednn", "native"])
def test_inference_tensor_weights_are_not_packed(kind, monkeypatch):
    """Weights made under torch.inference_mode have no version counter, so a pack could not notice an in-place
    change: they keep F.linear, also when the start-up timing picks a packing (before, packing them raised:
    a test failed whenever the timing of its tiny shape happened to favour a packing)."""
    if not packed_linear.available(kind):
        pytest.skip(f"torch without {kind} packing")
    import transformers

    from hf_paged import PagedGenerator, SamplingParams
    from hf_paged.model.layers import packed as packed_model
    from tests.helpers import stock_greedy

    monkeypatch.setattr(packed_model, "fastest_kind", lambda *a, **k: kind)

    with torch.inference_mode():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
        model = transformers.LlamaForCausalLM(config).eval()
    with PagedGenerator(model, num_blocks=64) as engine:
        assert engine.packed is None or len(engine.packed) == 0
        out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0].token_ids
    assert out == stock_greedy(model, [1, 2, 3], 4)
    with pytest.raises(RuntimeError, match="made under torch.inference_mode"):
        PagedGenerator(model, num_blocks=64, prepack_weights=kind)


def test_bad_prepack_value_leaves_model_untouched():
    from hf_paged import PagedGenerator
    from tests.helpers import make_model

    model = make_model("llama", seed=3)
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="prepack_weights"):
        PagedGenerator(model, num_blocks=16, prepack_weights="fast")
    assert model.config._attn_implementation == before


def test_packing_choice_margins():
    from hf_paged.kernels.cpu.packed_linear import choose_kind

    assert choose_kind({"torch": 100, "onednn": 95, "native": 97}) == "torch"  # not clearly faster than F.linear
    assert choose_kind({"torch": 100, "onednn": 80, "native": 70}) == "native"
    # within 15% of the fastest: native, whose packs the native decode program needs
    assert choose_kind({"torch": 100, "onednn": 60, "native": 68}) == "native"
    assert choose_kind({"torch": 100, "onednn": 50, "native": 68}) == "onednn"
    assert choose_kind({"torch": 100, "onednn": 80, "native": 91}) == "onednn"  # native not 10% under F.linear
    assert choose_kind({"torch": 100, "mkl": 50}) == "mkl"
    assert choose_kind({"torch": 100, "upcast": 70, "onednn": 78}) == "onednn"  # upcast needs 25%: twice the memory



@needs_native_bf16
def test_env_report_names_the_bf16_gemm_instructions(monkeypatch):
    """``hf-paged env`` says whether our bf16 GEMM runs on AMX tiles or VDPBF16PS on this host."""
    monkeypatch.setattr(packed_linear, "fastest_kind", lambda *a, **k: "native")
    text = packed_linear.describe_choice(torch.bfloat16)
    amx = bool(native_gemm.NATIVE_GEMM.load().hfp_gemm_bf16_amx())
    assert text.startswith("native (AMX tiles)" if amx else "native (VDPBF16PS)"), text
