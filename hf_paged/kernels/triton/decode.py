"""Split-K (flash-decoding) Triton kernel for steps where every sequence has at most one query token.

One program per (sequence, KV head, split): the query heads of one KV head form the rows of the tile
(GQA packing), so each key is read once for the whole group. With ``SPLIT`` the sequence's keys are cut
into ``num_splits`` chunks of ``split_size`` tokens attended by separate programs, each writing an
unnormalized partial output with its running max and denominator; ``_reduce_splits_kernel`` merges them.
Without ``SPLIT`` (short contexts or enough sequences to fill the device) the kernel writes the output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hf_paged.kernels.triton.common import attend_key_range


@triton.jit
def decode_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32 (SPLIT only)
    part_m_ptr,  # [num_seqs, num_heads, num_splits] fp32, base-2 running max (SPLIT only)
    part_l_ptr,  # [num_seqs, num_heads, num_splits] fp32, softmax denominator (SPLIT only)
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (int8 pool: head_dim + 4, see kv_quant.py)
    k_scale_ptr,  # KV_INT8: k_cache viewed as fp32 (the rows' scales); else unused
    v_scale_ptr,  # KV_INT8: v_cache viewed as fp32
    block_tables_ptr,  # [num_seqs, max_blocks]
    seq_lens_ptr,  # [num_seqs]
    cu_seqlens_q_ptr,  # [num_seqs + 1]; every sequence owns 0 or 1 query row
    num_splits,
    split_size,  # keys per split, a multiple of TILE_N
    scale,
    softcap,
    sliding_window,
    stride_o_token, stride_o_head, stride_o_dim,
    stride_q_token, stride_q_head, stride_q_dim,
    stride_kc_block, stride_kc_offset, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_offset, stride_vc_head, stride_vc_dim,
    stride_bt_seq,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # >= GROUP, >= 16 for tl.dot
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_INT8: tl.constexpr,  # the pool holds int8 rows with their scale; q stays in the query dtype
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - token
    seq_len = tl.load(seq_lens_ptr + seq)
    if q_len == 0:
        return

    # the split's key range, inside the window when there is one
    first_key = 0
    if USE_WINDOW:
        first_key = tl.maximum(seq_len - sliding_window, 0)
    lo = first_key + split * split_size
    hi = tl.minimum(lo + split_size, seq_len)

    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < GROUP
    heads = kv_head * GROUP + rows
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        query_ptr + token.to(tl.int64) * stride_q_token
        + heads[:, None] * stride_q_head + offs_d[None, :] * stride_q_dim,
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    if not KV_INT8:
        q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)

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

    store_mask = row_valid[:, None] & d_mask[None, :]
    if SPLIT:
        # an empty split (sequence shorter than its start) stores m = -inf, l = 0, acc = 0
        part = (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits + split  # [BLOCK_M]
        tl.store(part_out_ptr + part[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :], acc, mask=store_mask)
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token.to(tl.int64) * stride_o_token
            + heads[:, None] * stride_o_head + offs_d[None, :] * stride_o_dim,
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )


@triton.jit
def reduce_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32
    part_m_ptr,  # [num_seqs, num_heads, num_splits] fp32
    part_l_ptr,  # [num_seqs, num_heads, num_splits] fp32
    cu_seqlens_q_ptr,  # [num_seqs + 1]
    num_splits,
    stride_o_token, stride_o_head, stride_o_dim,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(cu_seqlens_q_ptr + seq)
    if tl.load(cu_seqlens_q_ptr + seq + 1) == token:
        return
    splits = tl.arange(0, NUM_SPLITS_PAD)
    split_mask = splits < num_splits
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    part = (seq * tl.num_programs(1) + head) * num_splits + splits  # [NUM_SPLITS_PAD]
    m = tl.load(part_m_ptr + part, mask=split_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=split_mask, other=0.0)
    acc = tl.load(
        part_out_ptr + part[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
        mask=split_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [NUM_SPLITS_PAD, HEAD_DIM_PAD]

    # -- rescale every split to the global max and merge --
    m_max = tl.max(m, 0)
    # -inf only for a padding sequence with no keys (seq_len 0): its output is 0, like an empty softmax's
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    denom = tl.sum(w * l, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + token.to(tl.int64) * stride_o_token + head * stride_o_head + offs_d * stride_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )
