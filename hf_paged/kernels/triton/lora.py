"""Triton kernels of the multi-LoRA delta, punica-style: one program per token reads that token's adapter.

A step's rows each carry a slot index (``index[t]``: the slot of the stacked adapter tensors, ``-1``: a base row,
whose programs return at once). The delta ``y[t] += scale[slot] * (x[t] @ A[slot].T) @ B[slot].T`` is two
launches per linear:

- shrink: ``s[t, :R] = x[t] @ A[slot[t], :R].T`` (fp32), one program per token, walking ``in_features``;
- expand: ``y[t, cols] += scale[slot[t]] * s[t] @ B[slot[t], cols, :R].T``, one program per (token, column tile),
  added into ``y`` in place (any strides: ``y`` may be a column view of a group GEMM's output).

``A`` is ``[num_slots, max_rank, in]`` and ``B`` ``[num_slots, out, max_rank]``, zero past each adapter's rank, so
every slot runs the same ``max_rank`` columns. The grids depend only on the (padded) token count and the
shapes, never on the slots' values: a CUDA graph captures the launches with ``index`` in a static buffer and
replays them for any mix of adapters. Weights may be fp32, fp16 or bf16; products and sums are fp32 (a GEMV
per token: no ``tl.dot``, so the interpreter's bf16 dot bug does not apply). Tile sizes are fixed heuristics
(no ``@triton.autotune``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 4096  # elements of a weight tile per program step (rank x columns)


@triton.jit
def lora_shrink_kernel(
    x_ptr,  # [num_tokens, in_features]
    a_ptr,  # [num_slots, max_rank, in_features]
    index_ptr,  # [num_tokens] int32/int64, the token's slot; -1: a base row
    s_ptr,  # [num_tokens, max_rank] fp32, written for adapter rows only
    in_features,
    max_rank,
    stride_x_token, stride_x_col,
    stride_a_slot, stride_a_rank, stride_a_col,
    stride_s_token, stride_s_rank,
    BLOCK_R: tl.constexpr,  # max_rank padded to a power of two
    BLOCK_K: tl.constexpr,  # input columns per loop step
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(index_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < max_rank
    a_rows = a_ptr + slot * stride_a_slot + offs_r[:, None] * stride_a_rank  # [BLOCK_R, 1]
    x_row = x_ptr + token * stride_x_token
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, in_features, BLOCK_K):
        # -- one tile of A's rows against the same columns of x --
        cols = start + offs_k
        k_mask = cols < in_features
        x = tl.load(x_row + cols * stride_x_col, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_rows + cols[None, :] * stride_a_col, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], 1)
    tl.store(s_ptr + token * stride_s_token + offs_r * stride_s_rank, acc, mask=r_mask)


@triton.jit
def lora_expand_kernel(
    s_ptr,  # [num_tokens, max_rank] fp32, the shrink's output
    b_ptr,  # [num_slots, out_features, max_rank]
    scale_ptr,  # [num_slots] fp32, each slot's adapter scale
    index_ptr,  # [num_tokens] int32/int64, the token's slot; -1: a base row
    y_ptr,  # [num_tokens, out_features], any strides, added into
    out_features,
    max_rank,
    stride_s_token, stride_s_rank,
    stride_b_slot, stride_b_col, stride_b_rank,
    stride_y_token, stride_y_col,
    BLOCK_R: tl.constexpr,  # max_rank padded to a power of two
    BLOCK_N: tl.constexpr,  # output columns per program
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(index_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = offs_r < max_rank
    n_mask = cols < out_features
    s = tl.load(s_ptr + token * stride_s_token + offs_r * stride_s_rank, mask=r_mask, other=0.0)
    b = tl.load(
        b_ptr + slot * stride_b_slot + cols[:, None] * stride_b_col + offs_r[None, :] * stride_b_rank,
        mask=n_mask[:, None] & r_mask[None, :],
        other=0.0,
    )  # [BLOCK_N, BLOCK_R]
    # -- PEFT's order: (B (A x)) * scale, then added to the base output --
    delta = tl.sum(b.to(tl.float32) * s[None, :], 1) * tl.load(scale_ptr + slot)
    y_ptrs = y_ptr + token * stride_y_token + cols * stride_y_col
    y = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def block_r(max_rank: int) -> int:
    """The rank tile: ``max_rank`` padded to a power of two (the lanes past it are masked)."""
    return max(16, triton.next_power_of_2(max_rank))


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, index: torch.Tensor, s: torch.Tensor) -> None:
    """``s[t] = x[t] @ a[index[t]].T`` for rows with ``index[t] >= 0`` (unchecked: :mod:`hf_paged.kernels.lora`
    checks). ``x`` ``[T, in]``, ``a`` ``[L, R, in]``, ``s`` ``[T, R]`` fp32 (base rows are left as they are)."""
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return
    rank_tile = block_r(a.shape[1])
    block_k = min(max(16, TILE_ELEMENTS // rank_tile), triton.next_power_of_2(max(a.shape[2], 16)))
    lora_shrink_kernel[(num_tokens,)](
        x, a, index, s,
        a.shape[2], a.shape[1],
        x.stride(0), x.stride(1),
        a.stride(0), a.stride(1), a.stride(2),
        s.stride(0), s.stride(1),
        BLOCK_R=rank_tile, BLOCK_K=block_k,
    )


def lora_expand_triton(s: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, index: torch.Tensor,
                       y: torch.Tensor) -> None:
    """``y[t] += scales[index[t]] * s[t] @ b[index[t]].T`` for rows with ``index[t] >= 0`` (unchecked).
    ``s`` ``[T, R]`` fp32, ``b`` ``[L, out, R]``, ``scales`` ``[L]`` fp32, ``y`` ``[T, out]`` any strides."""
    num_tokens, out_features = y.shape
    if num_tokens == 0 or out_features == 0:
        return
    rank_tile = block_r(b.shape[2])
    block_n = min(max(16, TILE_ELEMENTS // rank_tile), triton.next_power_of_2(max(out_features, 16)))
    grid = (num_tokens, triton.cdiv(out_features, block_n))
    lora_expand_kernel[grid](
        s, b, scales, index, y,
        out_features, b.shape[2],
        s.stride(0), s.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_R=rank_tile, BLOCK_N=block_n,
    )
