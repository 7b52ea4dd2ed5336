"""How one step writes K/V and attends, per attention backend (vLLM's attention backend / impl split, small).

The model runner picks one :class:`AttentionBackend` at start ("torch", "cpu", "triton"); for each step it
plans a :class:`StepAttention` once (gather indices, native-kernel arguments) and puts it in the step's
:class:`~hf_paged.attention.AttentionMetadata`; every layer's call of the ``"hf_paged"`` attention function then
runs it. A padded static step (decode buckets) uses :class:`StaticStepAttention`, one graph-safe op a layer.
"""

from __future__ import annotations

import torch

from hf_paged import kernels
from hf_paged.cpu import attention as cpu_attention
from hf_paged.kernels import TorchAttentionPlan, graph_ops  # noqa: F401 - graph_ops registers the static op


class StepAttention:
    """One step's store + attention for every layer: ``out [T, H, D]`` from ``q [T, H, D]``, ``k``/``v``
    ``[T, KVH, D]`` (already padded to the pool's head size) and the layer's pool tensors."""

    def __call__(self, meta, layer_idx: int, q, k, v, k_cache, v_cache, scale: float, sliding_window, softcap):
        raise NotImplementedError


class TorchStepAttention(StepAttention):
    """Vectorized torch (gather + SDPA per group of sequences); runs anywhere."""

    backend = "torch"

    def __init__(self, plan: TorchAttentionPlan) -> None:
        self.plan = plan

    def __call__(self, meta, layer_idx, q, k, v, k_cache, v_cache, scale, sliding_window, softcap):
        self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        return kernels.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.max_seqlen_q,
            meta.max_seqlen_k, scale=scale, sliding_window=sliding_window, softcap=softcap, backend=self.backend,
            plan=self.plan,
        )

    @staticmethod
    def store(k, v, k_cache, v_cache, slot_mapping) -> None:
        kernels.store_kv_torch(k, v, k_cache, v_cache, slot_mapping, has_padding=False)


class CpuStepAttention(TorchStepAttention):
    """The torch path with short queries (decode, verification, short prompts) in the native C kernel; where
    every sequence of the step is short, ``native`` stores and attends with two C calls a layer."""

    backend = "cpu"

    def __init__(self, plan: TorchAttentionPlan, native: cpu_attention.NativeStep | None) -> None:
        super().__init__(plan)
        self.native = native

    def __call__(self, meta, layer_idx, q, k, v, k_cache, v_cache, scale, sliding_window, softcap):
        if self.native is not None:
            out = self.native(layer_idx, q, k, v, scale, sliding_window, softcap)
            if out is not None:
                return out
        return super().__call__(meta, layer_idx, q, k, v, k_cache, v_cache, scale, sliding_window, softcap)

    @staticmethod
    def store(k, v, k_cache, v_cache, slot_mapping) -> None:
        kernels.store_kv_cpu(k, v, k_cache, v_cache, slot_mapping, has_padding=False)


class TritonStepAttention(StepAttention):
    """The Triton store, split-K decode and varlen kernels (CUDA; on CPU only under the interpreter)."""

    def __call__(self, meta, layer_idx, q, k, v, k_cache, v_cache, scale, sliding_window, softcap):
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend="triton")
        return kernels.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.max_seqlen_q,
            meta.max_seqlen_k, scale=scale, sliding_window=sliding_window, softcap=softcap, backend="triton",
        )


class StaticStepAttention(StepAttention):
    """A padded static-shape step (decode buckets): ``torch.ops.hf_paged.static_paged_attention``, one opaque
    op a layer that CUDA graphs capture and inductor compiles without a graph break."""

    def __call__(self, meta, layer_idx, q, k, v, k_cache, v_cache, scale, sliding_window, softcap):
        return torch.ops.hf_paged.static_paged_attention(
            q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
            meta.max_seqlen_q, meta.max_seqlen_k, scale, sliding_window, softcap,
        )


class AttentionBackend:
    """The engine's attention backend, chosen once; :meth:`plan` makes each step's :class:`StepAttention`.

    Args:
        name: "torch", "cpu" or "triton" (resolved: :func:`hf_paged.kernels.resolve_backend`).
        block_size: Tokens per block.
        native_max_q: Longest query the native CPU kernel takes (0: none; only for "cpu" on a pool it reads).
    """

    def __init__(self, name: str, block_size: int, native_max_q: int = 0) -> None:
        if name not in ("torch", "cpu", "triton"):
            raise ValueError(f"attention backend must be 'torch', 'cpu' or 'triton' here, got {name!r}")
        self.name = name
        self.block_size = block_size
        self.native_max_q = native_max_q if name == "cpu" else 0

    def plan(
        self, block_tables: torch.Tensor, seq_lens: list[int], q_lens: list[int], num_tokens: int,
        seq_lens_t: torch.Tensor, cu_seqlens_q_t: torch.Tensor, slot_mapping: torch.Tensor, kv_caches,
    ) -> StepAttention:
        """This step's attention (per-step work done here once, not per layer)."""
        if self.name == "triton":
            return TritonStepAttention()
        plan = TorchAttentionPlan(block_tables, seq_lens, q_lens, self.block_size, num_tokens, self.native_max_q,
                                  seq_lens_t, cu_seqlens_q_t)
        if self.name == "torch":
            return TorchStepAttention(plan)
        native = cpu_attention.NativeStep.build(plan, slot_mapping, kv_caches) if self.native_max_q else None
        return CpuStepAttention(plan, native)
