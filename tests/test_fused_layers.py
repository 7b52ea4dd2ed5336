"""The fused CPU decoder-layer forward (cpu/fused_layers.py) and its kernels (cpu/fused_ops.py)."""

from __future__ import annotations

import platform
import time

import pytest
import torch
import transformers

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.kernels.cpu import fused_ops, probes
from hf_paged.kernels.cpu.native import NativeLibrary
from tests.helpers import make_model, make_prompts, stock_greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernels_build_and_pass_their_probe(dtype):
    assert fused_ops.available(dtype), fused_ops.unavailable_reason(dtype)


@pytest.mark.parametrize("isa_flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2", "-mno-fma"), ("-mno-avx",)],
                         ids=["avx2", "no-avx2", "no-avx"])
def test_kernels_narrower_vector_builds(isa_flags, monkeypatch):
    """The bf16 loops are vectorized by the compiler for whatever ISA the build targets: build the narrower ones
    too, so an AVX-512 host also checks what AVX2-only CPUs run (the probe compares against the torch code)."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX") or platform.machine() != "x86_64":
        pytest.skip("x86 ISA flags")
    lib = NativeLibrary("fused_cpu.c", fused_ops.LIBRARY.functions, extra_flags=("-ffp-contract=off", *isa_flags))
    assert lib.load() is not None, lib.why
    monkeypatch.setattr(fused_ops, "LIBRARY", lib)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        fused_ops._probe(dtype)
    for dtype in (torch.float32, torch.bfloat16):
        _assert_rounds_like_torch(dtype)
        fused_ops._probe_argmax(dtype)
    fused_ops._probe_silu(torch.bfloat16)
    fused_ops._probe_silu(torch.float32)
    _assert_silu_mul_is_torch_bitwise()
    for dtype in (torch.float32, torch.bfloat16):  # the software rounding of subnormals where the build has no BF16
        _assert_norm_rounds_specials_like_torch(dtype)


def test_silu_mul_is_torch_for_every_bf16_gate():
    assert fused_ops.silu_mul_available(), probes.probe(fused_ops.PROBE_SILU, torch.bfloat16).reason
    _assert_silu_mul_is_torch_bitwise()


def _assert_silu_mul_is_torch_bitwise():
    """Every one of the 65536 bf16 gate values (NaNs, infinities, subnormals, where exp overflows) times random up
    values, in strided rows of one gate|up buffer as the GEMM writes them: torch's bits exactly."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(64, 1024)
    up = torch.randn(64, 1024, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    both = torch.cat([gate, up], dim=1)
    want = torch.nn.functional.silu(gate.clone()).mul_(up)
    lib = fused_ops.LIBRARY.load()
    lib.hfp_silu_mul_bf16(both.data_ptr(), both.stride(0), both.data_ptr() + 1024 * 2, both.stride(0), 64, 1024, 2)
    same = (both[:, :1024].view(torch.int16) == want.view(torch.int16)) | (both[:, :1024].isnan() & want.isnan())
    assert same.all(), f"{(~same).sum().item()} results differ, e.g. gate {gate[~same][:4].tolist()}"
    for rows, n in ((1, 7), (3, 40)):  # below and past one vector, through the Python entry point
        g, u = (torch.randn(rows, n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16) for _ in range(2))
        assert torch.equal(fused_ops.silu_mul_(g.clone(), u), torch.nn.functional.silu(g).mul_(u))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_gives_transformers_bits(dtype):
    """The C RMSNorm (and its residual add) sums the squares in torch's order for torch's vector width here:
    bit for bit transformers' LlamaRMSNorm, for rows shorter than a vector, with tails, and long enough for
    torch's cascade of partial sums, one row or many."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert fused_ops.rms_norm_exact(dtype), probes.probe(fused_ops.PROBE_NORM_EXACT, dtype).reason
    g = torch.Generator().manual_seed(7)
    for n in (5, 8, 31, 100, 576, 2048, 2049, 8200):
        norm = LlamaRMSNorm(n, eps=1e-5)
        norm.weight.data = torch.randn(n, generator=g).to(dtype)
        for rows in (1, 3, 66):
            x, res = ((torch.randn(rows, n, generator=g) * 3).to(dtype) for _ in range(2))
            with torch.no_grad():
                out, total = fused_ops.rms_norm(x, norm.weight, norm.variance_epsilon, residual=res)
                assert torch.equal(total, x + res)
                assert torch.equal(out, norm((x + res)[None])[0]), (n, rows)
                assert torch.equal(fused_ops.rms_norm(x, norm.weight, norm.variance_epsilon)[0], norm(x)), (n, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rounds_subnormals_and_specials_like_torch(dtype):
    _assert_norm_rounds_specials_like_torch(dtype)


def _assert_norm_rounds_specials_like_torch(dtype):
    """Rows holding subnormals (which the AVX-512 BF16 conversion instruction would flush: those vectors take the
    software rounding), zeros, infinities and NaN: the same bits as transformers' RMSNorm, the residual sum too
    (NaN where torch has NaN: torch's vectorized bf16 rounding writes every NaN as 0xffff, its scalar one keeps
    the sign and payload, as the kernel does)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    tiny = torch.finfo(torch.float32).tiny
    g = torch.Generator().manual_seed(11)
    n = 64
    norm = LlamaRMSNorm(n, eps=1e-5)
    norm.weight.data = torch.randn(n, generator=g).to(dtype)
    x = (torch.randn(6, n, generator=g) * tiny * 0.3).to(dtype)  # row 0: subnormals only (eps dominates)
    x[1, ::3] = 0.0
    x[2, 5] = float("inf")
    x[3, 7] = float("nan")
    x[4] = torch.randn(n, generator=g).to(dtype) * 1e-3
    x[4, ::2] *= tiny  # normal and subnormal values in one vector
    res = (torch.randn(6, n, generator=g) * tiny * 0.3).to(dtype)
    res[5] = -x[5]  # the sum is zeros: 0 / sqrt(eps)
    def same(got, want):
        as_int = torch.int16 if dtype == torch.bfloat16 else torch.int32
        return bool(((got.view(as_int) == want.view(as_int)) | (got.isnan() & want.isnan())).all())

    with torch.no_grad():
        out, total = fused_ops.rms_norm(x, norm.weight, norm.variance_epsilon, residual=res)
        assert same(total, x + res)
        assert same(out, norm((x + res)[None])[0])
        assert same(fused_ops.rms_norm(x, norm.weight, norm.variance_epsilon)[0], norm(x))


def test_silu_mul_takes_the_faster_of_its_two_paths(monkeypatch):
    """The C pass is used only where it was timed faster than torch's ops here; either way torch's bits."""
    assert fused_ops.silu_mul_available(), probes.probe(fused_ops.PROBE_SILU, torch.bfloat16).reason
    g, u = (torch.randn(4, 300, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16) for s in (1, 2))
    want = torch.nn.functional.silu(g).mul_(u)
    for faster in (True, False):
        monkeypatch.setitem(fused_ops._SILU_FASTER, torch.bfloat16, faster)
        assert (fused_ops.silu_mul_kernel(torch.bfloat16) is not None) == faster
        assert torch.equal(fused_ops.silu_mul_(g.clone(), u), want)
    slow = lambda *args: time.sleep(0.05)  # ~200x torch's call here: loses the timing however busy the host  # noqa: E731
    assert fused_ops._silu_is_faster(slow, torch.bfloat16, calls=2) is False
    # a warm start reads the choice from the tuning store instead of timing the kernel again
    from hf_paged.kernels.cpu import tuning_store

    asked, stored = [], []
    monkeypatch.setattr(tuning_store, "put", lambda key, timings: stored.append((key, timings)))
    for ours, theirs in ((1e-5, 2e-5), (2e-5, 1e-5)):
        monkeypatch.setattr(tuning_store, "get", lambda key: asked.append(key) or {"ours": ours, "torch": theirs})
        never = lambda *args: pytest.fail("timed although the store had the timings")  # noqa: E731
        assert fused_ops._silu_is_faster(never, torch.bfloat16) is (ours < theirs)
    assert asked == ["silu-mul:bfloat16:64x1536"] * 2 and stored == []
    monkeypatch.setattr(tuning_store, "get", lambda key: None)
    assert fused_ops._silu_is_faster(slow, torch.bfloat16, calls=2) is False
    assert [key for key, _ in stored] == ["silu-mul:bfloat16:64x1536"] and set(stored[0][1]) == {"ours", "torch"}


def test_silu_mul_refuses_bad_tensors():
    g, u = torch.randn(5, 33), torch.randn(5, 33)  # fp32 of a width torch does not vectorize throughout: torch's ops
    assert torch.equal(fused_ops.silu_mul_(g.clone(), u), torch.nn.functional.silu(g) * u)
    bf = torch.randn(5, 33).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"up: expected \(5, 33\) torch.bfloat16 like gate, got \(5, 32\)"):
        fused_ops.silu_mul_(bf, bf[:, :32].contiguous())
    with pytest.raises(ValueError, match="gate: expected a CPU fp32/bf16/fp16"):
        fused_ops.silu_mul_(bf.t(), bf.t())


def test_fp32_silu_mul_is_torch_where_it_serves_and_torch_elsewhere(monkeypatch):
    """The fp32 C pass (Sleef's exp, step by step) where torch vectorizes every element: torch's bits on strided
    gate|up rows as the fused MLP has them, one thread and two, a row split between two threads' ranges; shapes
    with a scalar remainder in torch (libm's exp) keep torch's ops, whose bits there the C pass would not give."""
    assert fused_ops.silu_mul_available(torch.float32), probes.probe(fused_ops.PROBE_SILU, torch.float32).reason
    monkeypatch.setitem(fused_ops._SILU_FASTER, torch.float32, True)
    serves = fused_ops.silu_f32_serves
    assert serves(1, 1536, 2) and serves(31, 1536, 2) and serves(33, 1024, 2) and serves(33, 1056, 1)
    assert not serves(3, 40, 1) and not serves(33, 1056, 2) and not serves(1, 1552, 2)  # 33 x 1056 / 2: 16 past a step
    calls = []
    kernel = fused_ops.LIBRARY.load().hfp_silu_mul_f32
    monkeypatch.setattr(fused_ops, "silu_mul_kernel", lambda dtype: (lambda *a: calls.append(a) or kernel(*a)))
    gen = torch.Generator().manual_seed(4)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows, n in ((1, 1536), (31, 1536), (33, 1024), (33, 1056), (3, 40)):
                both = torch.randn(rows, 2 * n, generator=gen) * 6
                want = torch.nn.functional.silu(both[:, :n].contiguous()) * both[:, n:]  # the stock model's order
                calls.clear()
                got = fused_ops.silu_mul_(both[:, :n], both[:, n:])
                assert bool(calls) == serves(rows, n, threads), (rows, n, threads)
                assert torch.equal(got, want), (rows, n, threads)
        # why the remainder keeps torch's ops: there torch's exp is libm's (on rows of 40, their last 8; one
        # thread, so that no thread's range starts inside a row), and the C pass differs in some of those results
        torch.set_num_threads(1)
        both, up = torch.randn(4000, 80, generator=gen) * 6, torch.ones(4000, 40)
        want = torch.nn.functional.silu(both[:, :40])
        kernel(both.data_ptr(), 80, up.data_ptr(), 40, 4000, 40, 1)
        differ = both[:, :40] != want
        assert differ[:, 32:].any() and not differ[:, :32].any()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_round_like_the_torch_code(dtype):
    _assert_rounds_like_torch(dtype)


def _assert_rounds_like_torch(dtype):
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(2, 33, 96, generator=g).to(dtype)
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)

    def norm(h):  # transformers' LlamaRMSNorm
        hf = h.float()
        return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    out, total = fused_ops.rms_norm(x, w, 1e-6, residual=res)
    assert torch.equal(total, x + res)
    if dtype == torch.bfloat16:  # the product of two rounded values: equal but for sum-order ties
        assert (out == norm(x + res)).float().mean() > 0.99
    torch.testing.assert_close(out, norm(x + res), rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
    for d in (16, 64, 80):  # half a head below, at and past (a tail) several vector widths
        q, k = torch.randn(33, 4 * d, generator=g).to(dtype), torch.randn(33, 2 * d, generator=g).to(dtype)
        angle = torch.randn(33, d // 2, generator=g).repeat(1, 2)
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        want_q, want_k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(
            q.view(1, 33, 4, d).transpose(1, 2), k.view(1, 33, 2, d).transpose(1, 2), cos[None], sin[None]
        )
        fused_ops.rope_(q, k, cos, sin)
        assert torch.equal(q, want_q.transpose(1, 2).reshape(33, 4 * d))  # same ops, same rounding: bitwise
        assert torch.equal(k, want_k.transpose(1, 2).reshape(33, 2 * d))


def test_kernels_refuse_bad_tensors():
    with pytest.raises(ValueError, match=r"x: expected a CPU fp32/bf16/fp16 \[rows, n\] tensor"):
        fused_ops.rms_norm(torch.randn(4, 8).t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="expected a CPU fp32/bf16/fp16"):
        fused_ops.rms_norm(torch.randn(4, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="argmax_rows takes fp32 or bf16 rows, got torch.float16"):
        fused_ops.argmax_rows(torch.randn(4, 8, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torch_max(dtype):
    """Greedy sampling's row argmax: the same indices and maxima as torch.max, ties to the first index (bf16
    logits tie often), NaN propagated, vocabularies not a multiple of the vector width."""
    assert fused_ops.argmax_available(dtype)
    g = torch.Generator().manual_seed(4)
    for n in (5, 16, 49152 + 7):
        x = (torch.randn(9, n, generator=g) * 3).round().to(dtype)  # small integers: many ties
        x[4, n // 2] = float("nan")
        x[5] = float("-inf")
        value, index = fused_ops.argmax_rows(x)
        want_value, want_index = x.max(dim=-1)
        assert torch.equal(index, want_index)
        assert torch.equal(value.nan_to_num(), want_value.float().nan_to_num()) and bool(value[4].isnan())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fused_engine_matches_stock_generate(arch, monkeypatch):
    model = make_model(arch, seed=4)
    calls = []
    real = fused_ops.rms_norm
    monkeypatch.setattr(fused_ops, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    # lengths around the Mistral window (48) and a block edge; a batch mixing prefill and decode
    prompts = make_prompts(5, lengths=[1, 16, 47, 49, 70], seed=arch.__len__())
    with PagedGenerator(model, num_blocks=96, block_size=16, max_num_seqs=3) as engine:
        assert engine.fused is not None and len(engine.fused) == model.config.num_hidden_layers
        outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    assert calls, "the fused forward never ran"
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == stock_greedy(model, prompt, 24)
    # given back on close: the layers run transformers' forward again
    assert not any(type(layer).__name__.startswith("Fused") for layer in model.model.layers)


def test_off_and_unfusable_models_keep_transformers_layers():
    model = make_model("llama", seed=5)
    with PagedGenerator(model, num_blocks=32, fuse_layers=False) as engine:
        assert engine.fused is None
        assert not any(type(layer).__name__.startswith("Fused") for layer in model.model.layers)
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )).eval()
    with PagedGenerator(gemma, num_blocks=16) as engine:
        assert engine.fused is None  # auto: nothing to fuse is fine
    with pytest.raises(RuntimeError, match="fuse_layers=True: no decoder layer of this model has a fused forward"):
        PagedGenerator(gemma, num_blocks=16, fuse_layers=True)
    assert gemma.config._attn_implementation != "hf_paged"  # the failed start gave everything back


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_fuse_layers_must_be_a_bool(value):
    with pytest.raises(TypeError, match=f"fuse_layers must be None or a bool, got {value!r}"):
        PagedGenerator(make_model("llama"), num_blocks=16, fuse_layers=value)


def test_shared_by_engines_and_plain_forwards_untouched():
    model = make_model("llama", seed=6)
    ids = torch.tensor([make_prompts(1, lengths=[12], seed=1)[0]])
    with torch.no_grad():
        before = model(ids).logits
    first = PagedGenerator(model, num_blocks=32)
    second = PagedGenerator(model, num_blocks=32)
    assert first.fused is second.fused is not None
    with torch.no_grad():  # outside an engine forward the layers run transformers' code
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    first.close()
    assert all(type(layer).__name__.startswith("Fused") for layer in model.model.layers)  # the other engine still holds it
    prompt = ids[0].tolist()
    out = second.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == stock_greedy(model, prompt, 8)
    second.close()
    assert not any(type(layer).__name__.startswith("Fused") for layer in model.model.layers)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_fused_layers_run_qkv_and_gate_up_as_one_gemm_each(arch):
    """With packed linears the fused forward runs q/k/v as one GEMM and gate/up as another (memory: the members'
    own packs are dropped), follows a weight changed between steps, and a member called on its own (a forward
    outside the fused path) packs itself again."""
    from hf_paged.model.layers.fused_decoder import GATE_UP, QKV

    model = make_model(arch, seed=7)
    prompts = make_prompts(3, lengths=[5, 18, 33], seed=7)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    with PagedGenerator(model, num_blocks=48, block_size=16, prepack_weights=True) as engine:
        assert engine.packed is not None and engine.fused is not None
        outs = engine.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert list(out.outputs[0].token_ids) == stock_greedy(model, prompt, 10)
        packs = engine.packed
        for layer in model.model.layers:
            qkv, gate_up = packs.group(layer.self_attn, QKV), packs.group(layer.mlp, GATE_UP)
            assert qkv is not None and gate_up is not None
            assert (qkv.bias is not None) == (arch == "qwen2")
            assert all(m._pack is None for m in qkv.modules + gate_up.modules)
        with torch.no_grad():  # an optimizer-like in-place update of one member between requests
            model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
            model.model.layers[-1].mlp.up_proj.weight.add_(0.01)
        outs = engine.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert list(out.outputs[0].token_ids) == stock_greedy(model, prompt, 10)
        engine.fused.remove()  # the layers run transformers' forward: each projection on its own pack again
        outs = engine.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert list(out.outputs[0].token_ids) == stock_greedy(model, prompt, 10)
        assert all(m._pack is not None for m in packs.group(model.model.layers[0].mlp, GATE_UP).modules)
