"""How one step writes K/V and attends, per attention backend (vLLM's attention backend / impl split, small).

The executor resolves the engine's ``attention_backend`` setting once ("auto" -> "torch", "cpu" or "triton")
and makes one :class:`AttentionBackend` of it (:func:`make_backend`). Every attention layer object
(:mod:`hf_paged.attention.layer`) holds it. For each step it plans a :class:`StepAttention` once (gather
indices, native-kernel arguments) and puts it in the step's :class:`~hf_paged.attention.function.AttentionMetadata`;
each layer's call then runs it. These objects call the concrete kernels of their backend directly: nothing on
the per-layer path resolves a backend name or probes a device. A padded static step (decode buckets) uses
:meth:`AttentionBackend.static`, one graph-safe op a layer running the same backend's kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hf_paged.kernels.cpu import attention as cpu_attention
from hf_paged.kernels.ops import store_kv_cpu, triton_ops
from hf_paged.kernels.torch_attention import TorchAttentionPlan, paged_attention_torch, store_kv_torch

if TYPE_CHECKING:
    from hf_paged.attention.function import AttentionMetadata
    from hf_paged.attention.layer import Attention

BACKEND_NAMES = ("torch", "cpu", "triton")


class StepAttention:
    """One step's store + attention for every layer: ``out [T, H, D]`` from ``q [T, H, D]``, ``k``/``v``
    ``[T, KVH, D]`` (already padded to the pool's head size) and the layer object (its pool tensors)."""

    def __call__(self, meta: AttentionMetadata, layer: Attention, q, k, v, scale: float, sliding_window, softcap):
        raise NotImplementedError

    def native_step(self) -> cpu_attention.NativeStep | None:
        """This step's native CPU store + attention, where every sequence of the step takes the native kernel
        (the native decode program replays its kernel calls with the step's arguments); None otherwise."""
        return None


class TorchStepAttention(StepAttention):
    """Vectorized torch (gather + SDPA per group of sequences); runs anywhere."""

    def __init__(self, plan: TorchAttentionPlan) -> None:
        self.plan = plan

    def __call__(self, meta, layer, q, k, v, scale, sliding_window, softcap):
        self.store(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
        return paged_attention_torch(
            q, layer.k_cache, layer.v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.max_seqlen_q,
            meta.max_seqlen_k, scale, sliding_window, softcap, plan=self.plan,
        )

    @staticmethod
    def store(k, v, k_cache, v_cache, slot_mapping) -> None:
        store_kv_torch(k, v, k_cache, v_cache, slot_mapping, has_padding=False)


class CpuStepAttention(TorchStepAttention):
    """The torch path with short queries (decode, verification, short prompts) in the native C kernel; where
    every sequence of the step is short, ``native`` stores and attends with two C calls a layer."""

    def __init__(self, plan: TorchAttentionPlan, native: cpu_attention.NativeStep | None) -> None:
        super().__init__(plan)
        self.native = native

    def __call__(self, meta, layer, q, k, v, scale, sliding_window, softcap):
        if self.native is not None:
            out = self.native(layer.layer_idx, q, k, v, scale, sliding_window, softcap)
            if out is not None:
                return out
        return super().__call__(meta, layer, q, k, v, scale, sliding_window, softcap)

    def native_step(self) -> cpu_attention.NativeStep | None:
        return self.native

    @staticmethod
    def store(k, v, k_cache, v_cache, slot_mapping) -> None:
        store_kv_cpu(k, v, k_cache, v_cache, slot_mapping, has_padding=False)


class TritonStepAttention(StepAttention):
    """The Triton store, split-K decode and varlen kernels (CUDA; on CPU only under the interpreter)."""

    def __init__(self, ops) -> None:
        self.ops = ops  # hf_paged.kernels.triton.attention, imported once by the backend

    def __call__(self, meta, layer, q, k, v, scale, sliding_window, softcap):
        self.ops.store_kv_triton(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
        return self.ops.paged_attention_triton(
            q, layer.k_cache, layer.v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.max_seqlen_q,
            meta.max_seqlen_k, scale, sliding_window, softcap,
        )


class StaticStepAttention(StepAttention):
    """A padded static-shape step (decode buckets): ``torch.ops.hf_paged.static_paged_attention``, one opaque
    op a layer that CUDA graphs capture and inductor compiles without a graph break, running ``backend``'s
    kernels (:mod:`hf_paged.kernels.graph_ops`)."""

    def __init__(self, backend: str) -> None:
        from hf_paged.kernels import graph_ops  # registers the op (~25 ms of torch.library): only engines with buckets

        if backend not in graph_ops.STATIC_BACKENDS:
            raise ValueError(f"static attention backend must be one of {graph_ops.STATIC_BACKENDS}, got {backend!r}")
        self.backend = backend

    def __call__(self, meta, layer, q, k, v, scale, sliding_window, softcap):
        return torch.ops.hf_paged.static_paged_attention(
            q, k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
            meta.cu_seqlens_q, meta.max_seqlen_q, meta.max_seqlen_k, scale, sliding_window, softcap, self.backend,
        )


class AttentionBackend:
    """The engine's attention backend, chosen once; :meth:`plan` makes each step's :class:`StepAttention`.

    Made by :func:`make_backend`; one subclass per backend, so a step's plan asks no question about which.

    Args:
        block_size: Tokens per block.
    """

    name: str
    native_max_q = 0  # longest query the native CPU kernel takes in this engine's steps (0: it never runs)

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def plan(
        self, block_tables: torch.Tensor, seq_lens: list[int], q_lens: list[int], num_tokens: int,
        seq_lens_t: torch.Tensor, cu_seqlens_q_t: torch.Tensor, slot_mapping: torch.Tensor, kv_caches,
    ) -> StepAttention:
        """This step's attention (per-step work done here once, not per layer)."""
        raise NotImplementedError

    def static(self) -> StaticStepAttention:
        """The attention of padded static steps (decode buckets), running this backend's kernels."""
        return StaticStepAttention(self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"


class TorchBackend(AttentionBackend):
    name = "torch"

    def plan(self, block_tables, seq_lens, q_lens, num_tokens, seq_lens_t, cu_seqlens_q_t, slot_mapping, kv_caches):
        return TorchStepAttention(TorchAttentionPlan(block_tables, seq_lens, q_lens, self.block_size, num_tokens,
                                                     0, seq_lens_t, cu_seqlens_q_t))


class CpuBackend(AttentionBackend):
    """Args: native_max_q: longest query the native CPU kernel takes (0: none, where it cannot read the pool)."""

    name = "cpu"

    def __init__(self, block_size: int, native_max_q: int = 0) -> None:
        super().__init__(block_size)
        self.native_max_q = native_max_q

    def plan(self, block_tables, seq_lens, q_lens, num_tokens, seq_lens_t, cu_seqlens_q_t, slot_mapping, kv_caches):
        plan = TorchAttentionPlan(block_tables, seq_lens, q_lens, self.block_size, num_tokens, self.native_max_q,
                                  seq_lens_t, cu_seqlens_q_t)
        native = cpu_attention.NativeStep.build(plan, slot_mapping, kv_caches) if self.native_max_q else None
        return CpuStepAttention(plan, native)

    def static(self) -> StaticStepAttention:
        # the native kernel only where it reads this pool; the torch path of the same op otherwise
        return StaticStepAttention("cpu" if self.native_max_q else "torch")


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self._step = TritonStepAttention(triton_ops())  # the kernels take the step's tensors: no per-step plan

    def plan(self, block_tables, seq_lens, q_lens, num_tokens, seq_lens_t, cu_seqlens_q_t, slot_mapping, kv_caches):
        return self._step


def make_backend(name: str, block_size: int, native_max_q: int = 0) -> AttentionBackend:
    """The backend object for a resolved backend name (:func:`hf_paged.kernels.resolve_backend`).

    Args:
        name: "torch", "cpu" or "triton".
        block_size: Tokens per block.
        native_max_q: For "cpu": the longest query the native kernel takes on this pool (0: none).
    """
    if name == "torch":
        return TorchBackend(block_size)
    if name == "cpu":
        return CpuBackend(block_size, native_max_q)
    if name == "triton":
        return TritonBackend(block_size)
    raise ValueError(f"attention backend must be one of {BACKEND_NAMES} here (resolved), got {name!r}")
