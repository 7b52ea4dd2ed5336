"""Host side of the Triton paged KV ops: input checks, launch heuristics, kernel launches.

Imported only when the Triton backend is used (``kernels.triton_ops``), so the package imports without
triton. The kernels themselves live next to this file by role: ``triton_store.py`` (KV store),
``triton_decode.py`` (split-K decode and its reduce), ``triton_varlen.py`` (prefill, chunked prefill,
speculative verification, mixed batches) and ``triton_common.py`` (their shared key loop).

Which attention kernel runs follows from host-side integers only (no device sync, so a step can be
captured in a CUDA graph): ``max_seqlen_q == 1`` takes the decode kernel, anything else the varlen
kernel. Tile sizes and the split count are heuristics (``@triton.autotune`` is avoided: it cannot run
under the interpreter and would make the first steps slow).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from hf_paged.kernels.kv_quant import head_dim_of

from hf_paged.kernels.triton.decode import decode_kernel, reduce_splits_kernel
from hf_paged.kernels.triton.store import store_kv_kernel
from hf_paged.kernels.triton.varlen import varlen_kernel

MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)  # int8: rows + scale (kv_quant.py)
MIN_KEYS_PER_SPLIT = 256  # a split shorter than this costs more in setup and reduce than it saves
MAX_SPLITS = 32
INTERPRETER_NUM_SMS = 4  # stands in for the device's SM count under TRITON_INTERPRET=1


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of an attention kernel."""

    block_m: int  # query rows per program (tokens x query heads of one KV head)
    tile_n: int  # keys per inner-loop iteration
    num_warps: int
    num_stages: int


def head_dim_pad(head_dim: int) -> int:
    """The power-of-two tile width for ``head_dim`` (80 -> 128): extra lanes are masked, never read."""
    return max(16, triton.next_power_of_2(head_dim))


def decode_config(head_dim: int, group: int, dtype: torch.dtype) -> TileConfig:
    """Decode reads the KV cache once: the row tile is the GQA group (padded to tl.dot's minimum of 16),
    the key tile as wide as keeps the K and V tiles near 16 KB each (fp32 and head_dim 256 halve it)."""
    wide = head_dim_pad(head_dim) > 128
    tile_n = (32 if wide else 64) // (2 if dtype == torch.float32 else 1)
    return TileConfig(block_m=max(16, triton.next_power_of_2(group)), tile_n=tile_n, num_warps=4, num_stages=2)


def varlen_config(head_dim: int, group: int, max_seqlen_q: int, dtype: torch.dtype, kv_int8: bool = False) -> TileConfig:
    """Prefill is bound by compute: 128 query rows per program (8 warps) when there are enough of them,
    64 otherwise; smaller tiles for head_dim 256 and for fp32 (whose "ieee" dot runs on FMA units, in
    registers). Chosen so no configuration spills registers or needs more than ~100 KB of shared memory
    (checked by compiling for sm_80/sm_90 in tests/test_triton_kernels.py). An int8 pool's dequantized tiles
    take registers of their own: 8 warps share them, and head_dim 256 takes 16 keys a tile (compiled for sm_80,
    head_dim 80 with softcap spilled at 4 warps, also with 32 keys; head_dim 256 spilled at 32 keys)."""
    wide = head_dim_pad(head_dim) > 128
    if dtype == torch.float32:
        block_m, tile_n, num_warps = (32, 16, 8) if wide else (64, 32, 8)
    elif wide:
        block_m, tile_n, num_warps = 64, 32, 4
    elif max_seqlen_q * group >= 256:
        block_m, tile_n, num_warps = 128, 64, 8
    else:
        block_m, tile_n, num_warps = 64, 64, 4
    if kv_int8 and dtype != torch.float32:
        tile_n, num_warps = (16, num_warps) if wide else (tile_n, 8)
    return TileConfig(
        block_m=max(block_m, triton.next_power_of_2(group)), tile_n=tile_n, num_warps=num_warps, num_stages=2
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seqlen_k: int, num_sms: int) -> int:
    """Split count of the decode kernel (flash-decoding).

    Without splitting a decode step runs ``num_seqs * num_kv_heads`` programs; split each sequence's keys
    until there are about two programs per SM, but keep at least ``MIN_KEYS_PER_SPLIT`` keys per split
    and at most ``MAX_SPLITS`` splits. Few long sequences split; many sequences or short contexts don't.
    """
    programs = num_seqs * num_kv_heads
    want = triton.cdiv(2 * num_sms, max(programs, 1))
    splits = min(want, max_seqlen_k // MIN_KEYS_PER_SPLIT, MAX_SPLITS)
    return max(splits, 1)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the Triton kernels run on CUDA tensors, got device {t.device}; on CPU they run only under the "
            "Triton interpreter (TRITON_INTERPRET=1 set before triton is imported)"
        )


def _check_index(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dtype not in (torch.int32, torch.int64) or t.device != device:
        raise ValueError(f"expected {name} as int32/int64 on {device}, got {t.dtype} on {t.device}")


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or v_cache.device != k_cache.device:
        raise ValueError(
            f"expected v_cache like k_cache {tuple(k_cache.shape)} {k_cache.dtype} on {k_cache.device}, "
            f"got {tuple(v_cache.shape)} {v_cache.dtype} on {v_cache.device}"
        )
    if k_cache.dtype not in DTYPES:
        raise ValueError(f"the Triton kernels support caches in {DTYPES}, got {k_cache.dtype}")
    if head_dim_of(k_cache) > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels support head_dim <= {MAX_HEAD_DIM}, got {head_dim_of(k_cache)}")
    if k_cache.dtype == torch.int8 and (k_cache.stride(3) != 1 or k_cache.shape[3] % 4 or any(s % 4 for s in k_cache.stride()[:3])):
        raise ValueError(f"expected an int8 pool of rows of head_dim + 4 bytes, contiguous, got {tuple(k_cache.shape)}")


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int, int]:
    return cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3)


def _scale_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 views of int8 pools (where the kernels find each row's scale); the pools themselves otherwise."""
    if k_cache.dtype != torch.int8:
        return k_cache, v_cache
    return k_cache.view(torch.float32), v_cache.view(torch.float32)


def store_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], any strides
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], any strides
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = skip
) -> None:
    """Triton twin of ``store_kv``: write ``key``/``value`` (cast to the cache dtype) at ``slot_mapping``."""
    _check_device(key)
    _check_cache_pair(k_cache, v_cache)
    _check_index("slot_mapping", slot_mapping, key.device)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    d_pad = head_dim_pad(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // d_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    store_kv_kernel[grid](
        key, value, k_cache, v_cache, *_scale_views(k_cache, v_cache), slot_mapping.contiguous(),
        num_kv_heads,
        *key.stride(), *value.stride(), *_cache_strides(k_cache), *_cache_strides(v_cache),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, BLOCK_H=block_h,
        KV_INT8=k_cache.dtype == torch.int8,
    )


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], any strides
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Triton twin of ``paged_attention`` (same arguments and result; see ``kernels.paged_attention``).

    ``num_splits`` forces the decode kernel's split count (tests, benchmarks); by default
    :func:`choose_num_splits` picks it. It is ignored when some sequence has more than one query token.
    """
    _check_device(query)
    _check_cache_pair(k_cache, v_cache)
    if k_cache.dtype not in (query.dtype, torch.int8) or query.dtype not in DTYPES[:3]:
        raise ValueError(f"expected query in the cache dtype {k_cache.dtype} (or any float over an int8 pool), got {query.dtype}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)):
        _check_index(name, t, query.device)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    common = dict(
        query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        seq_lens=seq_lens.contiguous(), cu_seqlens_q=cu_seqlens_q.contiguous(), out=out,
        scale=float(scale), softcap=float(softcap or 1.0), sliding_window=int(sliding_window or 1),
        use_softcap=softcap is not None, use_window=sliding_window is not None,
    )
    if max_seqlen_q == 1:
        kv_span = max_seqlen_k if sliding_window is None else min(max_seqlen_k, sliding_window)
        if num_splits is None:
            num_splits = choose_num_splits(num_seqs, k_cache.shape[2], kv_span, _num_sms(query.device))
        _launch_decode(num_splits=num_splits, kv_span=kv_span, **common)
    else:
        _launch_varlen(max_seqlen_q=max_seqlen_q, **common)
    return out


def _strides(query, k_cache, v_cache, block_tables, out) -> tuple[int, ...]:
    """The stride arguments shared by the attention kernels, in their order (out, query, caches, block table)."""
    return (*out.stride(), *query.stride(), *_cache_strides(k_cache), *_cache_strides(v_cache), block_tables.stride(0))


def _constexprs(
    query: torch.Tensor, k_cache: torch.Tensor, cfg: TileConfig, use_softcap: bool, use_window: bool
) -> dict:
    num_heads, num_kv_heads, head_dim = query.shape[1], k_cache.shape[2], query.shape[2]
    return dict(
        KV_INT8=k_cache.dtype == torch.int8,
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=cfg.block_m,
        BLOCK_SIZE=k_cache.shape[1],
        TILE_N=cfg.tile_n,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad(head_dim),
        USE_SOFTCAP=use_softcap,
        USE_WINDOW=use_window,
        # fp32 parity with the reference needs true fp32 products, not the TF32 default of tl.dot
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _launch_decode(
    *, query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, softcap, sliding_window,
    use_softcap, use_window, num_splits, kv_span,
) -> None:
    num_seqs, num_heads, num_kv_heads, head_dim = seq_lens.shape[0], query.shape[1], k_cache.shape[2], query.shape[2]
    cfg = decode_config(head_dim, num_heads // num_kv_heads, query.dtype)
    split_size = triton.cdiv(triton.cdiv(max(kv_span, 1), num_splits), cfg.tile_n) * cfg.tile_n
    num_splits = triton.cdiv(max(kv_span, 1), split_size)  # rounding split_size up may leave fewer splits
    split = num_splits > 1
    if split:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        part_out = part_m = part_l = out  # unused
    decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_out, part_m, part_l, query, k_cache, v_cache, *_scale_views(k_cache, v_cache), block_tables, seq_lens,
        cu_seqlens_q,
        num_splits, split_size, scale, softcap, sliding_window, *_strides(query, k_cache, v_cache, block_tables, out),
        SPLIT=split, **_constexprs(query, k_cache, cfg, use_softcap, use_window),
    )
    if split:
        reduce_splits_kernel[(num_seqs, num_heads)](
            out, part_out, part_m, part_l, cu_seqlens_q, num_splits, *out.stride(),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim),
            NUM_SPLITS_PAD=triton.next_power_of_2(num_splits),
        )


def _launch_varlen(
    *, query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, softcap, sliding_window,
    use_softcap, use_window, max_seqlen_q,
) -> None:
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    cfg = varlen_config(head_dim, group, max_seqlen_q, query.dtype, k_cache.dtype == torch.int8)
    block_q = cfg.block_m // group
    # sequence s owns program ids from cu_seqlens_q[s] // block_q + s; see triton_varlen.py
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    varlen_kernel[grid](
        out, query, k_cache, v_cache, *_scale_views(k_cache, v_cache), block_tables, seq_lens, cu_seqlens_q,
        num_seqs, scale, softcap, sliding_window, *_strides(query, k_cache, v_cache, block_tables, out),
        BLOCK_Q=block_q, **_constexprs(query, k_cache, cfg, use_softcap, use_window),
    )
