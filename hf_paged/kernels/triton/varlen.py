"""Varlen Triton kernel: query tokens over each sequence's cached keys, causal within the new tokens.

One kernel serves prefill, chunked prefill over a cached prefix, speculative verification and mixed
batches (decodes are sequences with one query token). A program attends one tile of query rows against
one KV head. The tile packs ``BLOCK_Q = BLOCK_M // GROUP`` consecutive query tokens times the ``GROUP``
query heads that share the KV head (row ``r`` is token ``r // GROUP``, head ``r % GROUP``), so each
key tile read serves the whole group.

Programs are laid out without a host sync: sequence ``s`` owns program ids starting at
``cu_seqlens_q[s] // BLOCK_Q + s`` (enough for its ``cdiv(q_len, BLOCK_Q)`` tiles), so the grid is
``num_tokens // BLOCK_Q + num_seqs`` and each program finds its sequence by binary search.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hf_paged.kernels.triton.common import attend_key_range


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose tile range holds ``tile`` (``num_seqs`` when past the last one)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        next_start = tl.load(cu_seqlens_q_ptr + mid + 1) // BLOCK_Q + mid + 1
        lo = tl.where(next_start <= tile, mid + 1, lo)
        hi = tl.where(next_start <= tile, hi, mid)
    return lo


@triton.jit
def varlen_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (int8 pool: head_dim + 4, see kv_quant.py)
    k_scale_ptr,  # KV_INT8: k_cache viewed as fp32 (the rows' scales); else unused
    v_scale_ptr,  # KV_INT8: v_cache viewed as fp32
    block_tables_ptr,  # [num_seqs, max_blocks]
    seq_lens_ptr,  # [num_seqs]
    cu_seqlens_q_ptr,  # [num_seqs + 1]
    num_seqs,
    scale,
    softcap,
    sliding_window,
    stride_o_token, stride_o_head, stride_o_dim,
    stride_q_token, stride_q_head, stride_q_dim,
    stride_kc_block, stride_kc_offset, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_offset, stride_vc_head, stride_vc_dim,
    stride_bt_seq,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # query rows per tile: BLOCK_Q tokens x GROUP heads (+ padding rows)
    BLOCK_Q: tl.constexpr,  # BLOCK_M // GROUP
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_INT8: tl.constexpr,  # the pool holds int8 rows with their scale; q stays in the query dtype
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q)
    if seq >= num_seqs:
        return
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_q = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query token of the tile, within the sequence
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    heads = kv_head * GROUP + rows % GROUP
    tokens = (q_start + q_idx).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    io_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(
        query_ptr + tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head + offs_d[None, :] * stride_q_dim,
        mask=io_mask,
        other=0.0,
    )
    if not KV_INT8:
        q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = context_len + q_idx

    # keys this tile can see: causal up to its last token, window back from its first
    hi = tl.minimum(context_len + first_q + BLOCK_Q, seq_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context_len + first_q - sliding_window + 1, 0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = attend_key_range(
        acc, m_i, l_i, q, q_pos, lo, hi,
        block_tables_ptr + seq.to(tl.int64) * stride_bt_seq, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head,
        stride_kc_block, stride_kc_offset, stride_kc_head, stride_kc_dim,
        stride_vc_block, stride_vc_offset, stride_vc_head, stride_vc_dim,
        scale, softcap, sliding_window,
        BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION, KV_INT8,
    )

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_o_token + heads[:, None] * stride_o_head + offs_d[None, :] * stride_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )
