"""``torch.ops.hf_paged.static_paged_attention``: store + attend as one opaque op for static-shape decode.

The bucketed decode runner (:mod:`hf_paged.executor.decode_buckets`) replays one padded step shape many times: as a
CUDA graph, through ``torch.compile`` (inductor) or eagerly. Its attention layers call this op instead of the
dynamic path, whose per-step plan reads sequence lengths on the host. Registered as a custom op, it is one
node of a compiled graph (no graph break per layer) and takes only tensors of fixed shapes:

- padding rows sit at the end of the batch with ``slot_mapping = -1`` (their K/V is never written) and
  ``seq_lens = 0`` (nothing is read for them); their output rows are zeros on the torch paths and unspecified
  on Triton;
- ``backend`` is the engine's attention backend, passed by the engine's static step attention
  (:meth:`hf_paged.attention.backends.AttentionBackend.static`); the op runs that backend's kernels whatever
  the device, and never probes or resolves anything itself:
  - "triton": the Triton store and attention kernels with host arguments fixed per bucket (``max_seqlen_k``
    is the engine's ``max_model_len``), so it can be captured in a CUDA graph;
  - "torch": the torch store (skipping ``-1`` slots) and the vectorized torch attention over the real rows
    only (it reads the real row count on the host: not capturable, so CUDA graphs need "triton");
  - "cpu": as "torch", with the native CPU kernel for the short queries where the tensors' layout fits it.
"""

from __future__ import annotations

import torch

from hf_paged.kernels.cpu import attention as cpu_attention
from hf_paged.kernels import triton_ops
from hf_paged.kernels.torch_attention import TorchAttentionPlan, paged_attention_torch, store_kv_torch

STATIC_BACKENDS = ("triton", "torch", "cpu")

# The torch attention plan (gather indices, native-kernel rows) depends only on the step's sequence lengths and
# block tables, which every layer shares: built by the first layer of a step, reused by the others. Cached per
# engine: keyed by the address of its decode buckets' persistent block-table buffer (engines and threads never
# share one), and dropped by new_step() when the buckets refill that buffer for the next step.
_plans: dict[int, tuple] = {}
_triton = None  # the Triton kernels' module, imported by the first "triton" call


def _load_triton():
    global _triton
    _triton = triton_ops()
    return _triton


def new_step(block_tables: torch.Tensor) -> None:
    """The decode buckets refilled ``block_tables`` (their persistent buffer): its cached plan is stale."""
    _plans.pop(block_tables.data_ptr(), None)


def _plan(block_tables, seq_lens, cu_seqlens_q, block_size: int, native: int):
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
    backend: str,  # "triton", "torch" or "cpu": the engine's, fixed per bucket
) -> torch.Tensor:
    if backend == "triton":
        ops = _triton or _load_triton()
        ops.store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
        return ops.paged_attention_triton(
            query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
            scale, sliding_window, softcap,
        )
    if backend not in STATIC_BACKENDS:
        raise ValueError(f"static_paged_attention backend must be one of {STATIC_BACKENDS}, got {backend!r}")
    return _static_torch(query, key, value, k_cache, v_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q,
                         max_seqlen_q, scale, sliding_window, softcap,
                         native=backend == "cpu" and cpu_attention.supports(query, k_cache))


def _static_torch(query, key, value, k_cache, v_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q,
                  max_seqlen_q, scale, sliding_window, softcap, native: bool) -> torch.Tensor:
    """The "torch" (``native`` False) and "cpu" paths: store the real rows, attend over the real sequences."""
    store_kv_torch(key, value, k_cache, v_cache, slot_mapping, has_padding=True)
    out = torch.zeros_like(query)
    num_real, rows, longest, plan = _plan(block_tables, seq_lens, cu_seqlens_q, k_cache.shape[1],
                                          cpu_attention.MAX_Q if native else 0)
    if num_real == 0:
        return out
    out[:rows] = paged_attention_torch(
        query[:rows], k_cache, v_cache, block_tables[:num_real], seq_lens[:num_real], cu_seqlens_q[: num_real + 1],
        max_seqlen_q, longest, scale, sliding_window, softcap, plan=plan,
    )
    return out


@static_paged_attention.register_fake
def _(query, key, value, k_cache, v_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q,
      max_seqlen_k, scale, sliding_window, softcap, backend):
    return torch.empty_like(query)
