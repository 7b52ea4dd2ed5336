"""The int8 KV cache's row format: quantize on store, dequantize on read (torch side; the C and Triton kernels
implement the same format).

An int8 pool (``kv_cache_dtype="int8"``) keeps each (token, KV head) as one row of ``head_dim + 4`` bytes: the
``head_dim`` int8 values, then their fp32 scale (4 bytes, little-endian, at a 4-byte aligned offset because
``head_dim`` is a multiple of 4). The cache tensors are int8 of shape
``[num_blocks, block_size, num_kv_heads, head_dim + 4]``, so every block move (copy-on-write, swap, prefix
reuse) carries the scales with the values and needs no change.

Quantization is symmetric per row: ``scale = absmax / 127`` (fp32), ``q = clamp(floor(x / scale + 0.5), -127,
127)`` computed in fp32 whatever the model dtype (round half up, the same in torch, C and Triton), and an
all-zero row stores scale 0 and zeros. Reading gives ``q * scale``, whose error is at most ``scale / 2`` a value.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8")
SCALE_BYTES = 4  # one fp32 scale per (token, KV head) row
QMAX = 127.0
# dividing by at least the smallest normal float keeps an all-zero row at 0 (0 / tiny = 0) without a branch
TINY = torch.finfo(torch.float32).tiny


def check_kv_cache_dtype(value: object) -> str:
    """``value`` if it is a supported ``kv_cache_dtype`` (ValueError naming the allowed set otherwise)."""
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {value!r}")
    return value


def is_int8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is an int8 pool tensor (rows of int8 values and an fp32 scale)."""
    return cache.dtype == torch.int8


def row_size(head_dim: int) -> int:
    """Last dimension of an int8 pool tensor for ``head_dim`` (values + scale bytes)."""
    if head_dim % 4:
        raise NotImplementedError(f"the int8 KV cache needs head_dim divisible by 4 (the fp32 scale is aligned), got {head_dim}")
    return head_dim + SCALE_BYTES


def head_dim_of(cache: torch.Tensor) -> int:
    """The attention head size a pool tensor holds: its last dimension, less the scale bytes for int8."""
    return cache.shape[-1] - SCALE_BYTES if is_int8(cache) else cache.shape[-1]


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` (any float dtype) as int8 rows ``[..., D + 4]``: the quantized values, then the fp32 scale."""
    d = x.shape[-1]
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / QMAX  # [..., 1]
    q = torch.floor(xf / scale.clamp_min(TINY) + 0.5).clamp_(-QMAX, QMAX).to(torch.int8)
    rows = torch.empty(*x.shape[:-1], row_size(d), dtype=torch.int8, device=x.device)
    rows[..., :d] = q
    rows[..., d:] = scale.contiguous().view(torch.int8)
    return rows


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows ``[..., D + 4]`` back to ``[..., D]`` in ``dtype`` (values times their row's scale, in fp32)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :d].float() * scale).to(dtype)


def dequantize_cache(cache: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A whole pool tensor as ``[num_blocks, block_size, num_kv_heads, head_dim]`` floats (tests, references);
    a float pool is returned as it is."""
    return dequantize_rows(cache, dtype) if is_int8(cache) else cache
