"""Paged KV ops, dispatched on device: ``store_kv`` and ``paged_attention`` (docs/architecture.md, docs/cpu.md).

These public ops resolve ``backend`` on every call: they are for direct callers (tests, tools). The engine
resolves its backend once at start and its attention layers call the concrete implementations
(:mod:`hf_paged.attention.backends`).

``backend``:
- "auto": Triton for CUDA tensors; on CPU "cpu" when the native kernel builds and passes its probe for
  the cache dtype here, else "torch".
- "torch": vectorized torch (gather + SDPA per group of sequences); runs anywhere.
- "cpu": the torch path, with short queries (decode, speculative verification) computed by a native C
  kernel that reads the pool in place (``hf_paged/kernels/cpu/attention.py``).
- "triton": the Triton kernels (on CPU only under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch

from hf_paged.kernels.cpu import attention as cpu_attention
from hf_paged.kernels.kv_quant import head_dim_of
from hf_paged.kernels.torch_attention import TorchAttentionPlan, paged_attention_torch, store_kv_torch

BACKENDS = ("auto", "torch", "cpu", "triton")


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """Map "auto" to the concrete backend for ``device`` and ``dtype`` and check the choice can run here."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        return "cpu" if device.type == "cpu" and cpu_attention.available(dtype) else "torch"
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on CPU tensors, got device {device}")
        if not cpu_attention.available(dtype):
            raise RuntimeError(
                f"attention_backend='cpu' needs its native kernel, which does not work here for {dtype} "
                f"({cpu_attention.unavailable_reason(dtype)}); use 'torch' or 'auto'"
            )
    if backend == "triton":
        if not triton_available():
            raise ImportError("attention_backend='triton' needs the triton package: pip install 'hf-paged[triton]'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"attention_backend='triton' runs on CUDA tensors, got device {device}; on CPU it runs only "
                "under the Triton interpreter (set TRITON_INTERPRET=1 before importing triton)"
            )
    return backend


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_ops():
    """The Triton kernels' module (``store_kv_triton``, ``paged_attention_triton``), imported on first use: the
    package imports without triton. The engine's Triton backend imports it once, at start."""
    try:
        from hf_paged.kernels.triton import attention as triton_attention
    except ImportError as e:
        raise ImportError(f"the Triton backend failed to import ({e}); pip install 'hf-paged[triton]'") from e
    return triton_attention


def _check_cache(name: str, cache: torch.Tensor, ref: torch.Tensor) -> None:
    if cache.dim() != 4:
        raise ValueError(f"expected {name} of shape [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(cache.shape)}")
    if cache.device != ref.device:
        raise ValueError(f"expected {name} on {ref.device}, got {cache.device}")
    if cache.dtype == torch.int8 and (cache.shape[3] <= 4 or cache.shape[3] % 4):
        raise ValueError(f"expected an int8 {name} of rows of head_dim + 4 bytes (a multiple of 4), got {tuple(cache.shape)}")


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Write one step's keys and values into the paged pool.

    Args:
        key: ``[num_tokens, num_kv_heads, head_dim]``.
        value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        v_cache: same shape as ``k_cache``, written in place.
        slot_mapping: ``[num_tokens]`` int32/int64, ``block_id * block_size + offset``; -1 skips the token.
        backend: "auto", "torch", "cpu" or "triton".
    """
    _check_cache("k_cache", k_cache, key)
    if key.shape != value.shape or key.shape[1:] != (k_cache.shape[2], head_dim_of(k_cache)):
        raise ValueError(
            f"expected key/value of shape [num_tokens, {k_cache.shape[2]}, {head_dim_of(k_cache)}], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"expected slot_mapping of shape [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    resolved = resolve_backend(backend, key.device, k_cache.dtype)
    if resolved == "triton":
        triton_ops().store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    elif resolved == "cpu":
        store_kv_cpu(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_torch(key, value, k_cache, v_cache, slot_mapping)


def store_kv_cpu(key, value, k_cache, v_cache, slot_mapping, has_padding: bool | None = None) -> None:
    """The "cpu" backend's store (unchecked, for the engine's hot path): one native call where it applies
    (same dtype, int64 slots, contiguous rows), else the torch path."""
    if not cpu_attention.store_kv_native(key, value, k_cache, v_cache, slot_mapping):
        store_kv_torch(key, value, k_cache, v_cache, slot_mapping, has_padding=has_padding)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    plan: TorchAttentionPlan | None = None,
) -> torch.Tensor:
    """Varlen attention of each query token over its own sequence's cached keys.

    Sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``, the last ``q_len`` of its
    ``seq_lens[s]`` tokens; they attend causally. One op serves decode (q_len 1), prefill, chunked
    prefill over a cached prefix and speculative verification (q_len 1+k).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``; ``num_heads`` a multiple of ``num_kv_heads`` (GQA).
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        v_cache: same shape as ``k_cache``.
        block_tables: ``[num_seqs, max_blocks]`` int32, padded with 0 (never read past ``seq_lens``).
        seq_lens: ``[num_seqs]`` tokens of each sequence in the cache, this step's included.
        cu_seqlens_q: ``[num_seqs + 1]`` offsets of each sequence's query rows.
        max_seqlen_q: largest query length.
        max_seqlen_k: largest ``seq_lens`` entry.
        scale: softmax scale applied to ``q @ k``.
        sliding_window: with window W a query at position p sees keys p-W+1 .. p (HF convention).
        softcap: ``scores = softcap * tanh(scores / softcap)`` before masking.
        backend: "auto", "torch", "cpu" or "triton".
        plan: precomputed per-step indices for the torch and cpu backends (built here when None).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in the query's dtype.
    """
    _check_cache("k_cache", k_cache, query)
    if query.dim() != 3 or query.shape[2] != head_dim_of(k_cache) or query.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"expected query of shape [num_tokens, k*{k_cache.shape[2]}, {head_dim_of(k_cache)}], got {tuple(query.shape)}"
        )
    if block_tables.dim() != 2 or cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"expected block_tables [num_seqs, max_blocks] and cu_seqlens_q [num_seqs + 1], got "
            f"{tuple(block_tables.shape)} and {tuple(cu_seqlens_q.shape)} for {seq_lens.shape[0]} sequences"
        )
    resolved = resolve_backend(backend, query.device, k_cache.dtype)
    if resolved == "triton":
        return triton_ops().paged_attention_triton(
            query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
            scale, sliding_window, softcap,
        )
    if plan is None and resolved == "cpu" and cpu_attention.supports(query, k_cache):
        plan = TorchAttentionPlan.build(
            block_tables, seq_lens, cu_seqlens_q, k_cache.shape[1], native_max_q=cpu_attention.MAX_Q
        )
    return paged_attention_torch(
        query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
        scale, sliding_window, softcap, plan=plan,
    )


__all__ = ["BACKENDS", "TorchAttentionPlan", "paged_attention", "resolve_backend", "store_kv", "store_kv_cpu", "triton_ops"]
