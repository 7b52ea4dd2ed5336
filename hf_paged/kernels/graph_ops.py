"""``torch.ops.hf_paged.static_paged_attention``: store + attend as one opaque op for static-shape decode.

The bucketed decode runner (:mod:`hf_paged.executor.decode_buckets`) replays one padded step shape many times: as a
CUDA graph, through ``torch.compile`` (inductor) or eagerly. Its attention layers call this op instead of the
dynamic path, whose per-step plan reads sequence lengths on the host. Registered as a custom op, it is one
node of a compiled graph (no graph break per layer) and takes only tensors of fixed shapes:

- padding rows sit at the end of the batch with ``slot_mapping = -1`` (their K/V is never written) and
  ``seq_lens = 0`` (nothing is read for them); their output rows are zeros on CPU and unspecified on CUDA;
- on CUDA it runs the Triton store and attention kernels with host arguments fixed per bucket
  (``max_seqlen_k`` is the engine's ``max_model_len``), so it can be captured;
- on CPU it runs the torch store (skipping ``-1`` slots) and the native kernel when it serves the dtype, the
  torch path otherwise, over the real rows only.
"""

from __future__ import annotations

import torch

from hf_paged.cpu import attention as cpu_attention
from hf_paged.kernels.torch_attention import TorchAttentionPlan, paged_attention_torch, store_kv_torch


# The CPU attention plan (gather indices, native-kernel rows) depends only on the step's sequence lengths and
# block tables, which every layer shares: built by the first layer of a step, reused by the others. Cached per
# engine: keyed by the address of its decode buckets' persistent block-table buffer (engines and threads never
# share one), and dropped by new_step() when the buckets refill that buffer for the next step.
_plans: dict[int, tuple] = {}


def new_step(block_tables: torch.Tensor) -> None:
    """The decode buckets refilled ``block_tables`` (their persistent buffer): its cached plan is stale."""
    _plans.pop(block_tables.data_ptr(), None)


def _cpu_plan(block_tables, seq_lens, cu_seqlens_q, block_size: int, native: int):
    """(real sequences, their query rows, longest of them, plan) of this step, built once per step."""
    key = (seq_lens.data_ptr(), block_tables.shape[0], native)
    cached = _plans.get(block_tables.data_ptr())
    if cached is None or cached[0] != key:
        num_real = int((seq_lens > 0).sum())
        built = (num_real, 0, 0, None)
        if num_real:
            tables, lens, cu = block_tables[:num_real], seq_lens[:num_real], cu_seqlens_q[: num_real + 1]
            plan = TorchAttentionPlan.build(tables, lens, cu, block_size, native_max_q=native)
            built = (num_real, int(cu[-1]), int(lens.max()), plan)
        cached = _plans[block_tables.data_ptr()] = (key, built)
    return cached[1]


@torch.library.custom_op("hf_paged::static_paged_attention", mutates_args=("k_cache", "v_cache"))
def static_paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 for padding
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, 0 for padding rows (at the end)
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    if query.device.type == "cuda":
        from hf_paged.kernels import triton_attention

        triton_attention.store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
        return triton_attention.paged_attention_triton(
            query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
            scale, sliding_window, softcap,
        )
    store_kv_torch(key, value, k_cache, v_cache, slot_mapping, has_padding=True)
    out = torch.zeros_like(query)
    native = cpu_attention.MAX_Q if (cpu_attention.supports(query, k_cache) and cpu_attention.available(query.dtype)
                                    and cpu_attention.available(k_cache.dtype)) else 0
    num_real, rows, longest, plan = _cpu_plan(block_tables, seq_lens, cu_seqlens_q, k_cache.shape[1], native)
    if num_real == 0:
        return out
    out[:rows] = paged_attention_torch(
        query[:rows], k_cache, v_cache, block_tables[:num_real], seq_lens[:num_real], cu_seqlens_q[: num_real + 1],
        max_seqlen_q, longest, scale, sliding_window, softcap, plan=plan,
    )
    return out


@static_paged_attention.register_fake
def _(query, key, value, k_cache, v_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q,
      max_seqlen_k, scale, sliding_window, softcap):
    return torch.empty_like(query)
