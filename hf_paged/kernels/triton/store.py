"""Triton kernel writing one step's keys and values into the paged pool at ``slot_mapping``."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _quantize_rows(x):
    # symmetric per row, as kv_quant.quantize_rows: scale = absmax / 127, q = clamp(floor(x / scale + 1/2), +-127)
    xf = x.to(tl.float32)
    scale = tl.max(tl.abs(xf), 1) / 127.0
    q = tl.floor(xf / tl.maximum(scale, 1.1754943508222875e-38)[:, None] + 0.5)
    return tl.minimum(tl.maximum(q, -127.0), 127.0), scale


@triton.jit
def store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (int8 pool: head_dim + 4)
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (int8 pool: head_dim + 4)
    k_scale_ptr,  # KV_INT8: k_cache viewed as fp32, where each row's scale goes; else unused
    v_scale_ptr,  # KV_INT8: v_cache viewed as fp32
    slot_mapping_ptr,  # [num_tokens], -1 = skip
    num_kv_heads,
    stride_k_token, stride_k_head, stride_k_dim,
    stride_v_token, stride_v_head, stride_v_dim,
    stride_kc_block, stride_kc_offset, stride_kc_head, stride_kc_dim,
    stride_vc_block, stride_vc_offset, stride_vc_head, stride_vc_dim,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,  # KV heads per program
    KV_INT8: tl.constexpr,  # quantize each (token, head) row: int8 values + fp32 scale (kernels/kv_quant.py)
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]

    k = tl.load(
        key_ptr + token * stride_k_token + heads[:, None] * stride_k_head + offs_d[None, :] * stride_k_dim, mask=mask,
        other=0.0,  # padded head_dim lanes: 0, so an int8 row's absmax ignores them
    )
    v = tl.load(
        value_ptr + token * stride_v_token + heads[:, None] * stride_v_head + offs_d[None, :] * stride_v_dim, mask=mask,
        other=0.0,  # padded head_dim lanes: 0, so an int8 row's absmax ignores them
    )
    kc = k_cache_ptr + block * stride_kc_block + offset * stride_kc_offset
    vc = v_cache_ptr + block * stride_vc_block + offset * stride_vc_offset
    if KV_INT8:
        k_row = block * stride_kc_block + offset * stride_kc_offset + heads * stride_kc_head  # [BLOCK_H]
        v_row = block * stride_vc_block + offset * stride_vc_offset + heads * stride_vc_head
        k, k_scale = _quantize_rows(k)
        v, v_scale = _quantize_rows(v)
        tl.store(k_scale_ptr + (k_row + HEAD_DIM) // 4, k_scale, mask=heads < num_kv_heads)
        tl.store(v_scale_ptr + (v_row + HEAD_DIM) // 4, v_scale, mask=heads < num_kv_heads)
    tl.store(
        kc + heads[:, None] * stride_kc_head + offs_d[None, :] * stride_kc_dim,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        vc + heads[:, None] * stride_vc_head + offs_d[None, :] * stride_vc_dim,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )
