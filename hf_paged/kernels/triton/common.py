"""The inner loop shared by the Triton decode and varlen kernels: online softmax over a range of paged keys.

A tile of ``BLOCK_M`` query rows (query heads of one KV head, possibly several tokens) walks the keys
``[lo, hi)`` of one sequence ``TILE_N`` tokens at a time. Each key is found through the block table
token by token, so the key tile is independent of ``block_size`` (any block size works, and a tile may
straddle blocks). Loads past ``hi`` are masked: unused cache entries (the tail of the last block, the
block table's padding) are never read.

Scores are kept in base 2 (``qk * scale * log2(e)``) so the softmax uses ``exp2``.

With ``KV_INT8`` the pool holds int8 rows ending with their fp32 scale (``hf_paged/kernels/kv_quant.py``): the
tile's values are dequantized in registers, and the scales are read through fp32 views of the same pools.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    # tanh(x) = 2 * sigmoid(2x) - 1: saturates to +-1 without overflow, available in the interpreter too.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def attend_key_range(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32, unnormalized output
    m_i,  # [BLOCK_M] fp32, running max of the base-2 scores
    l_i,  # [BLOCK_M] fp32, running softmax denominator
    q,  # [BLOCK_M, HEAD_DIM_PAD] in the cache dtype, the query's for int8 (padded head_dim lanes are 0)
    q_pos,  # [BLOCK_M] int32, absolute position of each query row in its sequence
    lo,  # first key position to visit
    hi,  # one past the last key position to visit (<= seq_len)
    block_table_ptr,  # [max_blocks] this sequence's row of block_tables
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (int8: head_dim + 4)
    k_scale_ptr,  # KV_INT8: k_cache viewed as fp32, [num_blocks, block_size, num_kv_heads, (head_dim + 4) / 4]
    v_scale_ptr,  # KV_INT8: the same view of v_cache
    kv_head,
    stride_kc_block, stride_kc_offset, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_offset, stride_vc_head, stride_vc_dim,
    scale,  # softmax scale (natural units)
    softcap,  # used only with USE_SOFTCAP
    sliding_window,  # used only with USE_WINDOW
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    qk_scale = scale * LOG2E
    for start in range(lo, hi, TILE_N):
        # -- gather the tile's keys and values through the block table --
        k_pos = start + offs_n
        k_valid = k_pos < hi
        block_ids = tl.load(block_table_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        offsets = k_pos % BLOCK_SIZE
        k_rows = block_ids * stride_kc_block + offsets * stride_kc_offset + kv_head * stride_kc_head
        v_rows = block_ids * stride_vc_block + offsets * stride_vc_offset + kv_head * stride_vc_head
        k = tl.load(
            k_cache_ptr + k_rows[None, :] + offs_d[:, None] * stride_kc_dim,
            mask=k_valid[None, :] & d_mask[:, None],
            other=0.0,
        )  # [HEAD_DIM_PAD, TILE_N]
        v = tl.load(
            v_cache_ptr + v_rows[:, None] + offs_d[None, :] * stride_vc_dim,
            mask=k_valid[:, None] & d_mask[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]
        if KV_INT8:
            # -- dequantize: each row's scale sits right after its values (an fp32 at element (row + HEAD_DIM) / 4) --
            k_scale = tl.load(k_scale_ptr + (k_rows + HEAD_DIM) // 4, mask=k_valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + (v_rows + HEAD_DIM) // 4, mask=k_valid, other=0.0)
            k = (k.to(tl.float32) * k_scale[None, :]).to(q.dtype)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)

        # -- compute qk (base 2), softcap, mask --
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
        if USE_SOFTCAP:
            s = softcap * _tanh(s * (scale / softcap)) * LOG2E
        else:
            s = s * qk_scale
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        # -- update m_i and l_i --
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no visible key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)

        # -- accumulate p @ v --
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
