"""Vectorized torch kernels against the readable reference."""

import platform

import pytest
import torch

from hf_paged.kernels.cpu import attention as cpu_attention

from hf_paged.kernels import TorchAttentionPlan, kv_quant, paged_attention, resolve_backend, store_kv
from hf_paged.kernels.cpu.native import NativeLibrary
from hf_paged.kernels.reference import paged_attention_reference, store_kv_reference
from hf_paged import PagedGenerator, SamplingParams
from tests.helpers import make_model, make_prompts, stock_greedy
from tests.kernel_cases import make_case

SHAPES = {
    "decode": ([5, 17, 1, 33], [1, 1, 1, 1]),
    "prefill": ([9, 23], [9, 23]),
    "chunk_over_prefix": ([20, 13], [7, 5]),
    "mixed": ([40, 3, 18, 7, 1, 26], [1, 3, 1, 7, 1, 26]),
    "spec_verify": ([12, 30, 8], [4, 4, 4]),
    "long_prefill_and_decodes": ([70, 9, 12], [40, 1, 1]),
}


CPU_BACKENDS = ["torch", "cpu"]


def test_native_kernel_builds_here():
    """The C compiler is part of our machines; if this fails, "auto" silently falls back to torch."""
    assert cpu_attention.available()
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_matches_reference(shape, heads, block_size, backend):
    seq_lens, q_lens = SHAPES[shape]
    case = make_case(seq_lens, q_lens, num_heads=heads[0], num_kv_heads=heads[1], block_size=block_size)
    want = paged_attention_reference(*case.args())
    got = paged_attention(*case.args(), backend=backend)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", ["decode", "mixed", "chunk_over_prefix", "long_prefill_and_decodes", "spec_verify"])
@pytest.mark.parametrize("window", [1, 4, 9])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_sliding_window_and_softcap(shape, window, softcap, backend):
    seq_lens, q_lens = SHAPES[shape]
    case = make_case(seq_lens, q_lens, num_heads=6, num_kv_heads=2, block_size=4, seed=3)
    want = paged_attention_reference(*case.args(), sliding_window=window, softcap=softcap)
    got = paged_attention(*case.args(), sliding_window=window, softcap=softcap, backend=backend)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_plan_is_reused_across_layers_and_windows():
    case = make_case(*SHAPES["mixed"], num_heads=4, num_kv_heads=2)
    plan = TorchAttentionPlan.build(case.block_tables, case.seq_lens, case.cu_seqlens_q, case.k_cache.shape[1])
    for window in (None, 3, None, 3):
        want = paged_attention_reference(*case.args(), sliding_window=window)
        got = paged_attention(*case.args(), sliding_window=window, backend="torch", plan=plan)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert set(plan.groups[0].masks) <= {None, 3}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ["mixed", "spec_verify"])
def test_low_precision_close_to_fp32_reference(dtype, backend, shape):
    case = make_case(*SHAPES[shape], num_heads=4, num_kv_heads=2, dtype=dtype)
    want = paged_attention_reference(*case.args())
    got = paged_attention(*case.args(), backend=backend)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_zero_length_query_rows_are_skipped(backend):
    case = make_case([6, 9, 4], [2, 0, 1], num_heads=4, num_kv_heads=2)
    want = paged_attention_reference(*case.args())
    got = paged_attention(*case.args(), backend=backend)
    torch.testing.assert_close(got[[0, 1, 2]], want[[0, 1, 2]], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("num_seqs", [1, 3, 40])  # fewer sequences than 2x threads split work by KV head
def test_native_kernel_head_dims_and_work_split(head_dim, num_seqs):
    g = torch.Generator().manual_seed(num_seqs)
    seq_lens = torch.randint(1, 70, (num_seqs,), generator=g).tolist()
    q_lens = [min(n, q) for n, q in zip(seq_lens, torch.randint(1, 17, (num_seqs,), generator=g).tolist())]
    case = make_case(seq_lens, q_lens, num_heads=8, num_kv_heads=4, head_dim=head_dim, block_size=16)
    plan = TorchAttentionPlan.build(case.block_tables, case.seq_lens, case.cu_seqlens_q, 16, native_max_q=16)
    assert plan.native_seq_ids is not None and not plan.groups  # every sequence went native
    want = paged_attention_reference(*case.args())
    got = paged_attention(*case.args(), backend="cpu", plan=plan)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads", [8, 16])
def test_native_kernel_splits_few_sequences_into_runs_of_kv_heads(dtype, num_heads):
    """Fewer sequences than 2x threads split each sequence into the fewest runs of KV heads that give the threads
    enough items (8 KV heads: 1 sequence on 2 threads -> 4 runs of 2 heads, on 4 threads -> 8 of 1; 3 sequences
    on 4 threads -> 4 runs of 2 heads; 5 on 4 -> 2 runs of 4), each run prefetching its part of the next block;
    every output as the reference's, a long sequence's key ranges included."""
    threads = torch.get_num_threads()
    try:
        for n_threads, seq_lens, q_lens in ((2, [70], [1]), (4, [70], [1]), (4, [40, 9, 33], [1, 2, 1]),
                                            (4, [21, 50, 7, 16, 33], [1, 1, 3, 1, 1]), (2, [300], [1])):
            torch.set_num_threads(n_threads)
            case = make_case(seq_lens, q_lens, num_heads=num_heads, num_kv_heads=8, head_dim=64, block_size=16,
                             dtype=dtype, seed=len(seq_lens) + n_threads)
            plan = TorchAttentionPlan.build(case.block_tables, case.seq_lens, case.cu_seqlens_q, 16, native_max_q=16)
            assert plan.native_seq_ids is not None and not plan.groups
            want = paged_attention_reference(*case.args())
            got = paged_attention(*case.args(), backend="cpu", plan=plan)
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window, softcap", [(None, None), (37, None), (None, 5.0)])
def test_native_kernel_splits_long_sequences_into_key_ranges(dtype, block_size, window, softcap):
    """One or two long sequences (fewer work items than 2x threads): each item's keys are split into ranges
    computed apart and merged (their softmax maxima and sums rescaled); decode, a prompt chunk over a long
    prefix, and rows whose every key of some range is masked (sliding window, causal chunk)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # the split depends on the thread count: make it happen on any host
    try:
        for seq_lens, q_lens in (([300], [1]), ([300], [16]), ([290, 130], [1, 9]), ([257], [40])):
            case = make_case(seq_lens, q_lens, num_heads=6, num_kv_heads=2, head_dim=64, block_size=block_size,
                             dtype=dtype, seed=len(seq_lens) + q_lens[0])
            plan = TorchAttentionPlan.build(case.block_tables, case.seq_lens, case.cu_seqlens_q, block_size,
                                            native_max_q=64)
            assert plan.native_seq_ids is not None and not plan.groups
            want = paged_attention_reference(*case.args(), sliding_window=window, softcap=softcap)
            got = paged_attention(*case.args(), sliding_window=window, softcap=softcap, backend="cpu", plan=plan)
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(threads)


def test_native_and_sdpa_groups_share_one_step():
    case = make_case(*SHAPES["long_prefill_and_decodes"], num_heads=4, num_kv_heads=2, block_size=4)
    plan = TorchAttentionPlan.build(case.block_tables, case.seq_lens, case.cu_seqlens_q, 4, native_max_q=16)
    assert plan.native_seq_ids.tolist() == [1, 2] and len(plan.groups) == 1
    want = paged_attention_reference(*case.args())
    torch.testing.assert_close(paged_attention(*case.args(), backend="cpu", plan=plan), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)  # "cpu": the native row copy
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_store_kv_matches_reference_and_skips_padding(block_size, backend):
    g = torch.Generator().manual_seed(0)
    num_blocks, kvh, d = 8, 2, 8
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    n = 7
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[2] = -1
    slots[5] = -1
    key, value = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
    store_kv(key, value, k_cache, v_cache, slots, backend=backend)
    store_kv_reference(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_store_kv_matches_reference(dtype):
    """The engine's CPU path stores K and V with one native call: same result, padding skipped, rows
    from a strided [T, H*D] projection, a slot past the pool refused before anything is written."""
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(6, 4, 2, 8, generator=g).to(dtype)
    v_cache = torch.randn(6, 4, 2, 8, generator=g).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([3, -1, 17, 0, 23])
    qkv = torch.randn(5, 3 * 16, generator=g).to(dtype)  # rows of a fused projection: strided views
    key, value = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    assert cpu_attention.store_kv_native(key, value, k_cache, v_cache, slots)
    store_kv_reference(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    with pytest.raises(IndexError, match="24 slots"):
        cpu_attention.store_kv_native(key, value, k_cache, v_cache, torch.tensor([1, 2, 24, 3, 4]))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # another dtype than the pool's: not applicable, nothing written (the torch path converts)
    assert not cpu_attention.store_kv_native(key.half(), value.half(), k_cache, v_cache, slots)


def test_store_kv_accepts_strided_views():
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    hf_layout = torch.randn(1, 2, 3, 8)  # HF's [batch, kv_heads, tokens, head_dim]
    key = hf_layout[0].transpose(0, 1)
    slots = torch.tensor([5, 6, 9])
    store_kv(key, key, k_cache, v_cache, slots, backend="torch")
    assert torch.equal(k_cache.view(-1, 2, 8)[slots], key)


def test_bad_shapes_raise_value_error():
    case = make_case([5], [1])
    with pytest.raises(ValueError, match="expected query"):
        paged_attention(case.query[:, :3], *case.args()[1:], backend="torch")
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(torch.zeros(2, 2, 16), torch.zeros(2, 2, 16), case.k_cache, case.v_cache, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="backend"):
        paged_attention(*case.args(), backend="cuda-magic")


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])  # 64, 128: bf16 dot products in hardware where the CPU has them
def test_native_kernel_bf16_head_dims(head_dim):
    case = make_case([5, 17, 40, 33], [1, 1, 4, 1], num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=16,
                     dtype=torch.bfloat16)
    plan = TorchAttentionPlan.build(case.block_tables, case.seq_lens, case.cu_seqlens_q, 16, native_max_q=16)
    assert plan.native_seq_ids is not None and not plan.groups
    want = paged_attention_reference(*case.args())
    got = paged_attention(*case.args(), backend="cpu", plan=plan)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _int8_pool(cache: torch.Tensor) -> torch.Tensor:
    """A float pool as int8 rows; its unused (NaN) rows keep a NaN scale, so reading one shows in the result."""
    rows = kv_quant.quantize_rows(torch.nan_to_num(cache.float()))
    rows[..., cache.shape[-1]:].view(torch.float32)[cache.isnan().any(-1)] = float("nan")
    return rows


@pytest.mark.parametrize("pool, qdtype, head_dim", [
    ("bf16", torch.bfloat16, 64),  # bf16 dot products in hardware where the CPU has them
    ("bf16", torch.bfloat16, 16),  # bf16 rows widened to fp32 first
    ("int8", torch.bfloat16, 64),  # int8 keys as bf16 (exact), their scale on the dot product
    ("int8", torch.float32, 64),   # int8 rows dequantized to fp32
    ("int8", torch.float32, 16),
])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window, softcap", [(None, None), (37, None), (None, 5.0)])
def test_native_grouped_rows_take_the_keys_a_chunk_of_blocks_at_a_time(pool, qdtype, head_dim, block_size, window,
                                                                        softcap):
    """bf16 queries over a bf16 pool, and any query over an int8 pool, take the grouped path on AVX-512: every
    row's scores for a chunk of blocks (up to 256 keys), one softmax update per row and chunk, then the chunk's
    values. Sequences of one chunk, several, and a partial last one; query rows whose causal edge or window
    starts or ends inside a chunk, or leaves a whole chunk masked; enough sequences that none is split."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seq_lens, q_lens = [700, 300, 257, 256, 120, 3], [1, 16, 5, 1, 40, 3]
        case = make_case(seq_lens, q_lens, num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                         dtype=qdtype if pool == "bf16" else torch.float32, seed=block_size + head_dim)
        case.query = case.query.to(qdtype)
        if pool == "int8":
            case.k_cache, case.v_cache = _int8_pool(case.k_cache), _int8_pool(case.v_cache)
            k_ref, v_ref = kv_quant.dequantize_rows(case.k_cache), kv_quant.dequantize_rows(case.v_cache)
        else:
            k_ref, v_ref = case.k_cache.float(), case.v_cache.float()
        args = list(case.args())
        args[0], args[1], args[2] = case.query.float(), k_ref, v_ref
        want = paged_attention_reference(*args, sliding_window=window, softcap=softcap)
        out = torch.full_like(case.query, float("nan"))
        i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
        cpu_attention.paged_attention_native(
            case.query, case.k_cache, case.v_cache, i32(case.block_tables), i32(case.seq_lens),
            i32(case.cu_seqlens_q), torch.arange(len(seq_lens), dtype=torch.int32), out, case.scale, window, softcap,
            max(q_lens))
        # fp32 results within fp32 rounding of the reference; bf16 ones within their final rounding
        tol = 2e-5 if qdtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa_flags", [("-mno-avx512bf16",), ("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2", "-mno-fma")],
                         ids=["avx512-no-bf16", "avx2", "no-avx2"])
def test_native_kernel_narrower_vector_paths(isa_flags, monkeypatch):
    """The kernel picks its vector width, exp path and bf16 dot products from the ISA it is built for (AVX-512
    with or without BF16, AVX2, scalar): build the narrower ones too, so an AVX-512 host also checks what
    AVX2-only CPUs run."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX") or platform.machine() != "x86_64":
        pytest.skip("x86 ISA flags")
    lib = NativeLibrary("paged_attention_cpu.c", cpu_attention.LIBRARY.functions, extra_flags=isa_flags)
    assert lib.load() is not None, lib.why
    monkeypatch.setattr(cpu_attention, "LIBRARY", lib)
    for shape, window, softcap in (("decode", None, None), ("spec_verify", 4, 5.0), ("mixed", None, None)):
        case = make_case(*SHAPES[shape], num_heads=6, num_kv_heads=2, block_size=16, seed=5)
        want = paged_attention_reference(*case.args(), sliding_window=window, softcap=softcap)
        got = paged_attention(*case.args(), sliding_window=window, softcap=softcap, backend="cpu")
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for head_dim in (16, 64, 80):  # bf16: grouped rows on AVX-512 (dot products in hardware where head_dim % 32 == 0)
        case = make_case([5, 17, 40, 33], [1, 1, 4, 1], num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=16,
                         dtype=torch.bfloat16, seed=6)
        want = paged_attention_reference(*case.args())
        got = paged_attention(*case.args(), backend="cpu")
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # a long sequence's keys split into ranges and merged (see the test above)
    try:
        case = make_case([300], [3], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, seed=7)
        want = paged_attention_reference(*case.args(), sliding_window=100)
        got = paged_attention(*case.args(), sliding_window=100, backend="cpu")
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_step_matches_store_then_attend(dtype):
    """A step of decodes and short verifications takes the per-step native fast path: its store + attention
    equals store_kv_cpu + paged_attention; tensors that do not fit return None (nothing written), and a
    step with a prefill chunk gets no fast path."""
    case = make_case([5, 17, 40, 33], [1, 1, 4, 1], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    g = torch.Generator().manual_seed(2)
    T = case.query.shape[0]
    qkv = torch.randn(T, (6 + 2 + 2) * 64, generator=g).to(dtype)  # q/k/v as column views of one projection
    q, k, v = (t.view(T, -1, 64) for t in qkv.split_with_sizes([6 * 64, 2 * 64, 2 * 64], dim=-1))
    tables, lens, cu = case.block_tables, case.seq_lens.tolist(), case.cu_seqlens_q.tolist()
    slots = torch.tensor([int(tables[s, p // 16]) * 16 + p % 16 for s in range(4) for p in range(lens[s] - (cu[s + 1] - cu[s]), lens[s])])
    plan = TorchAttentionPlan.build(tables, case.seq_lens, case.cu_seqlens_q, 16, native_max_q=cpu_attention.MAX_Q)
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    step = cpu_attention.NativeStep.build(plan, slots, [(case.k_cache, case.v_cache)])
    assert step is not None
    assert step(0, q.half(), k, v, case.scale, None, None) is None  # another dtype than the pool's
    assert step(0, q, k[:-1], v[:-1], case.scale, None, None) is None  # not one row per query token
    assert torch.equal(case.k_cache.nan_to_num(), k_ref.nan_to_num())
    got = step(0, q, k, v, case.scale, None, None)
    store_kv(k, v, k_ref, v_ref, slots, backend="cpu")
    want = paged_attention(q, k_ref, v_ref, *case.args()[3:], backend="cpu", plan=plan)
    assert torch.equal(case.k_cache.nan_to_num(), k_ref.nan_to_num()) and torch.equal(case.v_cache.nan_to_num(), v_ref.nan_to_num())
    assert torch.equal(got, want)
    long_q = cpu_attention.MAX_Q + 1  # a prefill chunk longer than the native kernel takes
    prefill = TorchAttentionPlan.build(
        torch.arange(12, dtype=torch.int32).view(2, 6), torch.tensor([5, long_q + 3], dtype=torch.int32),
        torch.tensor([0, 1, 1 + long_q], dtype=torch.int32), 16, native_max_q=cpu_attention.MAX_Q,
    )
    assert cpu_attention.NativeStep.build(prefill, slots, [(case.k_cache, case.v_cache)]) is None


def test_engine_decode_steps_take_the_native_step(monkeypatch):
    calls = []
    original = cpu_attention.NativeStep.__call__
    monkeypatch.setattr(cpu_attention.NativeStep, "__call__", lambda self, *a: calls.append(a[0]) or original(self, *a))
    model = make_model("llama")
    prompts = make_prompts(3, seed=2)
    # eager: the native decode program (tests/test_native_program.py) makes these calls without NativeStep
    engine = PagedGenerator(model, attention_backend="cpu", max_num_seqs=4, enforce_eager=True)
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)]
    assert got == [stock_greedy(model, p, 6) for p in prompts]
    assert calls and set(calls) == set(range(model.config.num_hidden_layers))
