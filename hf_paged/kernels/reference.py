"""Readable reference implementations of the paged KV ops. For tests only: one Python loop per sequence."""

from __future__ import annotations

import torch

from hf_paged.kernels.kv_quant import dequantize_cache, is_int8, quantize_rows


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = skip
) -> None:
    block_size = k_cache.shape[1]
    if is_int8(k_cache):
        key, value = quantize_rows(key), quantize_rows(value)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[t]
        v_cache[slot // block_size, slot % block_size] = value[t]


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
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
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each query token over its own sequence's cached keys, causal, in fp32 (an int8 pool is
    dequantized first)."""
    k_cache, v_cache = dequantize_cache(k_cache), dequantize_cache(v_cache)
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    cu = cu_seqlens_q.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = cu[s], cu[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        blocks = block_tables[s, : -(-seq_len // block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
