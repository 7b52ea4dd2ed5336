"""Vectorized torch implementation of the paged KV ops: the production path on CPU.

Attention gathers each sequence's keys token by token (``index_select`` over the flattened pool) into a
padded batch and runs one SDPA per *group* of sequences. Sequences are grouped by query length (all the
decodes of a step form one group) so there is no per-sequence Python loop on the decode hot path.

Padding slots of the gather point at the sequence's own first token instead of at unused cache
entries, so whatever sits in unused blocks (stale data, NaN) is never read, and masked positions only
ever multiply finite values by zero.

Everything derived from the step's metadata (gather indices, masks, output rows) is computed once per
step in a :class:`TorchAttentionPlan` and reused by every layer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hf_paged.kernels.cpu.attention import paged_attention_native
from hf_paged.kernels.kv_quant import dequantize_rows, is_int8, quantize_rows


def store_kv_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = skip
    has_padding: bool | None = None,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.long()
    if has_padding is None:
        has_padding = bool((slots < 0).any())
    if has_padding:
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    if is_int8(k_cache):  # rows of int8 values and their scale (hf_paged/kernels/kv_quant.py)
        key, value = quantize_rows(key), quantize_rows(value)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass
class _Group:
    """Sequences attended in one padded SDPA call."""

    seq_ids: list[int]
    max_q: int
    max_k: int
    q_rows: torch.Tensor | None  # [G * max_q] query rows to gather (None: rows are 0..T-1 in order)
    out_src: torch.Tensor | None  # [n_valid] rows of the flattened padded output that are real
    out_dst: torch.Tensor | None  # [n_valid] rows of ``out`` they go to (None with q_rows None)
    kv_slots: torch.Tensor  # [G, max_k] token slots in the flattened pool
    q_pos: torch.Tensor  # [G, max_q] absolute position of each query row
    k_len: torch.Tensor  # [G] sequence lengths
    ragged: bool  # sequence lengths differ, so even a plain decode needs a key-padding mask
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> bool [G, 1, max_q, max_k]

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        m = self.masks.get(sliding_window)
        if m is None:
            k_pos = torch.arange(self.max_k, device=self.kv_slots.device)
            q_pos = self.q_pos[:, :, None]
            m = (k_pos[None, None, :] <= q_pos) & (k_pos[None, None, :] < self.k_len[:, None, None])
            if sliding_window is not None:
                m &= k_pos[None, None, :] > q_pos - sliding_window
            # Padded query rows see key 0 so no row is fully masked (their output is dropped).
            m[:, :, 0] |= self.q_pos < 0
            m = m.unsqueeze(1)
            self.masks[sliding_window] = m
        return m


class TorchAttentionPlan:
    """Per-step gather indices and masks for :func:`paged_attention_torch`, shared by all layers.

    With ``native_max_q > 0`` the sequences with at most that many query tokens (decodes, speculative
    verification) are left to the native CPU kernel, which reads the pool in place; the plan then keeps
    int32 copies of the metadata it needs.
    """

    # A sequence with more query tokens than this gets a group of its own (long prefill chunks), the rest
    # are grouped by power-of-two query length.
    GROUP_MAX_Q = 16

    def __init__(
        self,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks]
        seq_lens: list[int],
        q_lens: list[int],
        block_size: int,
        num_tokens: int,
        native_max_q: int = 0,
        seq_lens_t: torch.Tensor | None = None,
        cu_seqlens_q_t: torch.Tensor | None = None,
    ) -> None:
        device = block_tables.device
        self.block_size = block_size
        self.num_tokens = num_tokens
        self.native_seq_ids: torch.Tensor | None = None
        self.native_max_q = 0
        q_starts = [0] * len(q_lens)
        acc = 0
        for s, n in enumerate(q_lens):
            q_starts[s] = acc
            acc += n
        buckets: dict[int, list[int]] = {}
        native = [s for s, n in enumerate(q_lens) if 0 < n <= native_max_q]
        if native:
            self.native_seq_ids = torch.tensor(native, dtype=torch.int32, device=device)
            self.native_max_q = max(q_lens[s] for s in native)
            self.block_tables_i32 = block_tables.to(torch.int32).contiguous()
            as_i32 = lambda t, values: (t if t is not None else torch.tensor(values)).to(device, torch.int32).contiguous()  # noqa: E731
            self.seq_lens_i32 = as_i32(seq_lens_t, seq_lens)
            self.cu_seqlens_q_i32 = as_i32(cu_seqlens_q_t, [0, *itertools.accumulate(q_lens)])
        for s, n in enumerate(q_lens):
            if n == 0 or n <= native_max_q:
                continue
            key = n if n > self.GROUP_MAX_Q else _next_pow2(n)
            if n > self.GROUP_MAX_Q:
                key = -s - 1  # a group of its own
            buckets.setdefault(key, []).append(s)
        block_tables = block_tables.long()
        self.groups = [
            self._make_group(ids, block_tables, seq_lens, q_lens, q_starts, device) for ids in buckets.values()
        ]

    def _make_group(self, ids, block_tables, seq_lens, q_lens, q_starts, device) -> _Group:
        bs = self.block_size
        max_q = max(q_lens[s] for s in ids)
        max_k = max(seq_lens[s] for s in ids)
        idx = torch.tensor(ids, device=device)
        k_len = torch.tensor([seq_lens[s] for s in ids], device=device)
        k_pos = torch.arange(max_k, device=device)
        nblk = -(-max_k // bs)
        slots = block_tables[idx, :nblk].repeat_interleave(bs, dim=1)[:, :max_k] * bs + k_pos % bs
        slots = torch.where(k_pos[None, :] < k_len[:, None], slots, slots[:, :1])
        q_off = torch.arange(max_q, device=device)
        q_len = torch.tensor([q_lens[s] for s in ids], device=device)
        q_valid = q_off[None, :] < q_len[:, None]
        q_pos = torch.where(q_valid, k_len[:, None] - q_len[:, None] + q_off[None, :], -1)
        # The group's query rows are the whole batch in order: no gather or scatter needed.
        in_order = len(ids) * max_q == self.num_tokens and all(
            q_starts[s] == i * max_q and q_lens[s] == max_q for i, s in enumerate(ids)
        )
        if in_order:
            q_rows = out_src = out_dst = None
        else:
            starts = torch.tensor([q_starts[s] for s in ids], device=device)
            rows = starts[:, None] + q_off[None, :]
            q_rows = torch.where(q_valid, rows, 0).reshape(-1)
            out_src = q_valid.reshape(-1).nonzero().squeeze(1)
            out_dst = rows.reshape(-1)[out_src]
        ragged = any(seq_lens[s] != max_k for s in ids)
        return _Group(ids, max_q, max_k, q_rows, out_src, out_dst, slots, q_pos, k_len, ragged)

    @classmethod
    def build(
        cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, block_size: int,
        native_max_q: int = 0,
    ) -> TorchAttentionPlan:
        cu = cu_seqlens_q.tolist()
        q_lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
        return cls(block_tables, seq_lens.tolist(), q_lens, block_size, cu[-1], native_max_q, seq_lens, cu_seqlens_q)


def _attend_group(
    g: _Group,
    q: torch.Tensor,  # [G, max_q, H, D]
    k: torch.Tensor,  # [G, max_k, KVH, D]
    v: torch.Tensor,  # [G, max_k, KVH, D]
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # [G, max_q, H, D]
    G, max_q, H, D = q.shape
    kvh = k.shape[2]
    rep = H // kvh
    k = k.transpose(1, 2)  # [G, KVH, max_k, D]
    v = v.transpose(1, 2)
    mask = g.mask(sliding_window)  # [G, 1, max_q, max_k]
    if softcap is None and max_q == 1:
        # Decode: fold the query heads of each KV head into the query axis (no K/V repeat).
        qh = q.view(G, kvh, rep, D)
        need_mask = sliding_window is not None or g.ragged
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask if need_mask else None, scale=scale)
        return out.reshape(G, 1, H, D)
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=rep > 1
        )  # [G, H, max_q, D]
        return out.transpose(1, 2)
    # Soft-capped logits (Gemma 2): explicit math in fp32.
    qf = q.float().view(G, max_q, kvh, rep, D).permute(0, 2, 3, 1, 4).reshape(G, kvh, rep * max_q, D)
    scores = torch.matmul(qf, k.float().transpose(-1, -2)) * scale  # [G, KVH, rep*max_q, max_k]
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.view(G, kvh, rep, max_q, -1).masked_fill(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(G, kvh, rep * max_q, -1)
    out = torch.matmul(probs, v.float())  # [G, KVH, rep*max_q, D]
    return out.view(G, kvh, rep, max_q, D).permute(0, 3, 1, 2, 4).reshape(G, max_q, H, D).to(q.dtype)


def paged_attention_torch(
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
    plan: TorchAttentionPlan | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]  # head_dim + 4 (the scale) for an int8 pool
    if plan is None:
        plan = TorchAttentionPlan.build(block_tables, seq_lens, cu_seqlens_q, k_cache.shape[1])
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    T, H, D = query.shape
    quantized = is_int8(k_cache)
    out = None
    if plan.native_seq_ids is not None:
        out = query.new_empty(T, H, D)
        paged_attention_native(
            query, k_cache, v_cache, plan.block_tables_i32, plan.seq_lens_i32, plan.cu_seqlens_q_i32,
            plan.native_seq_ids, out, scale, sliding_window, softcap, plan.native_max_q,
        )
    for g in plan.groups:
        G = len(g.seq_ids)
        slots = g.kv_slots.view(-1)
        k = k_flat.index_select(0, slots).view(G, g.max_k, num_kv_heads, head_dim)
        v = v_flat.index_select(0, slots).view(G, g.max_k, num_kv_heads, head_dim)
        if quantized:  # int8 rows: dequantize the gathered keys and values only
            k, v = dequantize_rows(k, query.dtype), dequantize_rows(v, query.dtype)
        if g.q_rows is None:
            q = query.reshape(G, g.max_q, H, D)
        else:
            q = query.index_select(0, g.q_rows).view(G, g.max_q, H, D)
        res = _attend_group(g, q, k, v, scale, sliding_window, softcap)
        if g.q_rows is None and out is None:
            return res.reshape(T, H, D)
        if out is None:
            out = query.new_zeros(T, H, D)
        out.index_copy_(0, g.out_dst, res.reshape(G * g.max_q, H, D).index_select(0, g.out_src))
    return out if out is not None else query.new_zeros(T, H, D)
