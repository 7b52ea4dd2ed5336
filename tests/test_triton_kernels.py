"""Triton kernels against the readable reference, run by the Triton interpreter (TRITON_INTERPRET=1, set in
conftest.py) on CPU, plus the same checks on CUDA under the ``gpu`` marker.

Shapes are tiny: every interpreted launch costs a good fraction of a second. The pools are NaN-filled
(``kernel_cases.make_case``) with permuted block tables and partial last blocks, so a kernel that reads an
unused cache entry returns NaN instead of passing by luck (the interpreter does not fault on stray loads).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from hf_paged import PagedGenerator, SamplingParams  # noqa: E402
from hf_paged.kernels import paged_attention, store_kv  # noqa: E402
from hf_paged.kernels.triton import attention as ta  # noqa: E402
from hf_paged.kernels.reference import paged_attention_reference, store_kv_reference  # noqa: E402
from tests.helpers import make_model, make_prompts, stock_greedy  # noqa: E402
from tests.kernel_cases import make_case  # noqa: E402

SHAPES = {
    "decode": ([5, 17, 1, 33, 64], [1, 1, 1, 1, 1]),
    "mixed": ([40, 3, 18, 7, 1, 26], [1, 3, 1, 7, 1, 26]),
    "chunk_over_prefix": ([50, 13], [23, 5]),
    "spec_verify": ([12, 30, 8], [4, 4, 4]),
}
GQA = {"1:1": (2, 2), "2:1": (4, 2), "3:1": (6, 2), "4:1": (8, 2)}
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check(case, sliding_window=None, softcap=None, num_splits=None):
    want = paged_attention_reference(*[a.cpu() if torch.is_tensor(a) else a for a in case.args()],
                                     sliding_window=sliding_window, softcap=softcap)
    got = ta.paged_attention_triton(*case.args(), sliding_window, softcap, num_splits=num_splits)
    assert got.dtype == case.query.dtype and got.shape == case.query.shape
    assert not got.isnan().any()
    tol = TOL[case.query.dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


# -- attention ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("gqa", list(GQA))
@pytest.mark.parametrize("head_dim", [64, 80])
def test_attention_matches_reference(shape, gqa, head_dim):
    heads, kv_heads = GQA[gqa]
    case = make_case(*SHAPES[shape], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                     seed=head_dim)
    _check(case)


@pytest.mark.parametrize("shape", ["decode", "mixed", "chunk_over_prefix"])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_fp16_close_to_reference(shape, head_dim):
    case = make_case(*SHAPES[shape], num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=torch.float16)
    _check(case)


@pytest.mark.parametrize("shape", ["decode", "mixed"])
@pytest.mark.parametrize("block_size", [1, 4, 32, 64, 256])
def test_block_sizes(shape, block_size):
    """Keys are gathered token by token, so a key tile may span many small blocks or part of a big one."""
    case = make_case(*SHAPES[shape], num_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size, seed=block_size)
    _check(case)


@pytest.mark.parametrize("shape", ["decode", "mixed", "chunk_over_prefix", "spec_verify"])
@pytest.mark.parametrize("window,softcap", [(1, None), (9, None), (None, 5.0), (9, 5.0)])
def test_sliding_window_and_softcap(shape, window, softcap):
    case = make_case(*SHAPES[shape], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, seed=3)
    _check(case, sliding_window=window, softcap=softcap)


# decode over long contexts: with fp32 the key tile is 32, so 200 keys in 3-4 splits leave partial and empty ones
SPLIT_SHAPE = ([200, 7, 130, 64], [1, 1, 1, 1])


@pytest.mark.parametrize("num_splits", [1, 2, 4, 7])
@pytest.mark.parametrize("window,softcap", [(None, None), (70, 5.0)])
def test_split_k_decode(num_splits, window, softcap):
    case = make_case(*SPLIT_SHAPE, num_heads=6, num_kv_heads=2, head_dim=80, block_size=16, seed=num_splits)
    _check(case, sliding_window=window, softcap=softcap, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_split_k_decode_fp16(num_splits):
    case = make_case(*SPLIT_SHAPE, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
    _check(case, num_splits=num_splits)


@pytest.mark.parametrize("shape", ["decode", "mixed"])
def test_gqa_7_to_1(shape):
    case = make_case(*SHAPES[shape], num_heads=7, num_kv_heads=1, head_dim=64, block_size=16, seed=7)
    _check(case, num_splits=2 if shape == "decode" else None)


@pytest.mark.parametrize("head_dim", [96, 128, 256])
def test_other_head_dims(head_dim):
    case = make_case(*SHAPES["mixed"], num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16)
    _check(case)
    case = make_case(*SHAPES["decode"], num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16)
    _check(case, num_splits=2)


def test_zero_length_query_rows_and_many_sequences():
    """Sequences without query rows own no output; many short ones exercise the tile -> sequence search."""
    seq_lens = [6, 9, 4, 70, 3, 1, 12, 40, 33, 2, 8]
    q_lens = [2, 0, 1, 70, 3, 0, 12, 1, 33, 2, 0]
    case = make_case(seq_lens, q_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    _check(case)


def test_long_prefill_spans_many_query_tiles():
    case = make_case([150, 90], [150, 61], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16)
    _check(case, sliding_window=50)


def test_strided_query_from_hf_layout():
    case = make_case(*SHAPES["mixed"], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    want = ta.paged_attention_triton(*case.args())
    case.query = case.query.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D] view of [H, T, D]
    assert not case.query.is_contiguous()
    torch.testing.assert_close(ta.paged_attention_triton(*case.args()), want)


def test_dispatch_through_public_ops():
    case = make_case(*SHAPES["mixed"], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    want = paged_attention_reference(*case.args(), sliding_window=5)
    got = paged_attention(*case.args(), sliding_window=5, backend="triton")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- KV store ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                    (torch.float16, torch.float16)])
def test_store_kv_matches_reference(block_size, dtypes):
    key_dtype, cache_dtype = dtypes
    g = torch.Generator().manual_seed(block_size)
    num_blocks, kv_heads, head_dim, n = 16 // block_size + 3, 3, 80, 9
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=cache_dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[[2, 5]] = -1
    # keys and values arrive as HF's [batch, kv_heads, tokens, head_dim] transposed to [tokens, kv_heads, head_dim]
    key = torch.randn(1, kv_heads, n, head_dim, generator=g).to(key_dtype)[0].transpose(0, 1)
    value = torch.randn(1, kv_heads, n, head_dim, generator=g).to(key_dtype)[0].transpose(0, 1)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_reference(key, value, k_ref, v_ref, slots)
    ta.store_kv_triton(key, value, k_cache, v_cache, slots.to(torch.int32))
    # bit-exact, NaN (never-written slots) included
    assert torch.equal(k_cache.view(torch.int16 if cache_dtype == torch.float16 else torch.int32),
                       k_ref.view(torch.int16 if cache_dtype == torch.float16 else torch.int32))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))


def test_store_kv_dispatch():
    k_cache, v_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    key = torch.randn(3, 2, 64)
    store_kv(key, -key, k_cache, v_cache, torch.tensor([17, -1, 63]), backend="triton")
    assert torch.equal(k_cache.view(-1, 2, 64)[[17, 63]], key[[0, 2]])
    assert torch.equal(v_cache.view(-1, 2, 64)[[17, 63]], -key[[0, 2]])
    assert k_cache.view(-1, 2, 64).abs().sum(dim=(1, 2)).nonzero().flatten().tolist() == [17, 63]


# -- heuristics and errors ---------------------------------------------------------------------------------


def test_split_heuristic():
    sms = 132
    assert ta.choose_num_splits(1, 8, 512, sms) == 2  # two splits of 256 keys at least
    assert ta.choose_num_splits(1, 8, 32768, sms) == ta.MAX_SPLITS  # 8 programs, capped
    assert ta.choose_num_splits(4, 8, 32768, sms) == 9  # 32 programs -> ~264
    assert ta.choose_num_splits(64, 8, 32768, sms) == 1  # 512 programs already fill the device
    assert ta.choose_num_splits(2, 8, 100, sms) == 1  # short context: not worth a reduce
    for seqs, heads, keys in [(1, 1, 10**6), (3, 2, 4000), (200, 32, 50)]:
        assert 1 <= ta.choose_num_splits(seqs, heads, keys, sms) <= ta.MAX_SPLITS


def test_tile_configs_fit_the_kernels():
    for d in (64, 80, 96, 128, 256):
        for group in (1, 3, 7, 8, 32):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                dec = ta.decode_config(d, group, dtype)
                assert dec.block_m >= max(16, group)
                for q in (1, 16, 4096):
                    cfg = ta.varlen_config(d, group, q, dtype)
                    assert cfg.block_m >= group and cfg.block_m >= 16 and cfg.tile_n >= 16
    assert ta.head_dim_pad(80) == 128 and ta.head_dim_pad(8) == 16


def test_bad_inputs_raise_value_error(monkeypatch):
    case = make_case([5], [1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match="float16"):
        ta.paged_attention_triton(case.query.half(), *case.args()[1:])
    big = make_case([5], [1], num_heads=2, num_kv_heads=1, head_dim=320, block_size=16)
    with pytest.raises(ValueError, match="320"):
        ta.paged_attention_triton(*big.args())
    with pytest.raises(ValueError, match="sliding_window"):
        ta.paged_attention_triton(*case.args(), 0)
    with pytest.raises(ValueError, match="softcap"):
        ta.paged_attention_triton(*case.args(), None, -1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        ta.paged_attention_triton(*case.args()[:4], case.seq_lens.float(), *case.args()[5:])
    with pytest.raises(ValueError, match="slot_mapping"):
        ta.store_kv_triton(case.query[:, :2], case.query[:, :2], case.k_cache, case.v_cache, torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        ta.paged_attention_triton(*case.args())
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        paged_attention(*case.args(), backend="triton")


# -- end to end --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_engine_greedy_parity_on_triton(arch):
    """A whole generation on the Triton kernels: chunked prefill over cached prefixes, mixed steps, decode."""
    model = make_model(arch)
    prompts = make_prompts(3, [5, 60, 19], seed=1)  # 60 > mistral's window of 48
    new_tokens = 6
    want = [stock_greedy(model, p, new_tokens) for p in prompts]
    engine = PagedGenerator(model, block_size=16, num_blocks=64, max_num_batched_tokens=32,
                            attention_backend="triton")
    assert engine.backend == "triton"
    outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0), use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    engine.close()


# -- CUDA only ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_matches_reference(dtype, head_dim, shape):
    for heads, kv_heads in [(6, 2), (7, 1), (8, 8)]:
        case = make_case(*SHAPES[shape], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                         dtype=dtype, device="cuda")
        _check(case)
        _check(case, sliding_window=9, softcap=5.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_gpu_block_sizes_and_split_k(dtype, block_size):
    g = torch.Generator().manual_seed(block_size)
    seq_lens = torch.randint(1, 3000, (9,), generator=g).tolist()
    case = make_case(seq_lens, [1] * 9, num_heads=32, num_kv_heads=8, head_dim=128, block_size=block_size,
                     dtype=dtype, device="cuda")
    for splits in (None, 1, 5, 32):
        _check(case, num_splits=splits)
    case = make_case(seq_lens, [min(n, 300) for n in seq_lens], num_heads=32, num_kv_heads=8, head_dim=128,
                     block_size=block_size, dtype=dtype, device="cuda")
    _check(case, sliding_window=512)


@pytest.mark.gpu
def test_gpu_store_kv_bf16():
    k_cache = torch.zeros(8, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(5, 2, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([3, -1, 40, 127, 64], device="cuda")
    store_kv(key, key, k_cache, v_cache, slots, backend="auto")
    assert torch.equal(k_cache.view(-1, 2, 128)[slots[slots >= 0]], key[slots >= 0])


# -- compiled for real GPUs, without one ---------------------------------------------------------------------


def test_kernels_compile_for_nvidia_targets():
    """The interpreter accepts code that the compiler rejects; compile every launch configuration the heuristics
    pick for sm_80 and sm_90 (no GPU needed) and check shared memory and register spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "tests.triton_aot"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_benchmark_script_runs_in_the_interpreter():
    """hf_paged/bench/kernels.py is for GPUs; here only its argument parsing and one tiny interpreted run."""
    from hf_paged.bench import kernels as bench

    assert bench.parse_args([]).device == "cuda"
    rows = bench.main(["--device", "cpu", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--batch-sizes", "2",
                       "--context-lens", "40", "--prefill-batch-sizes", "1", "--prefill-lens", "20"])
    assert {(r.kind, r.backend) for r in rows} == {("decode", "triton"), ("decode", "torch"), ("prefill", "triton"),
                                                   ("prefill", "torch"), ("prefill", "sdpa-dense")}
    assert all(r.max_abs_diff < 1e-5 for r in rows if r.backend == "triton")
