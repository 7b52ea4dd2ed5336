"""One engine's attention layers: an :class:`Attention` object per decoder layer, built once at engine start.

When an engine attaches to a model it learns each attention layer's settings from one probe forward
(:func:`hf_paged.executor.kv_pool.probe_kv_layout`: the scaling, sliding window and softcap the layer's module passes
to the attention function, its head counts and sizes) and allocates the layer's KV pool tensors. It then
builds, per layer, one :class:`Attention` holding all of that and the engine's attention backend object
(:mod:`hf_paged.attention.backends`, chosen once). The step's :class:`~hf_paged.attention.function.AttentionMetadata`
carries the engine's :class:`AttentionLayers`; the registered ``"hf_paged"`` function finds the layer's
object there by ``layer_idx`` and calls it. Nothing is read from the module, and no backend is chosen, per call.

The objects belong to the engine, not to the model's modules: several engines on one model each pass their
own, and closing one (:meth:`AttentionLayers.clear`) changes nothing on the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hf_paged.attention.function import AttentionMetadata
    from hf_paged.attention.backends import AttentionBackend


@dataclass(frozen=True)
class AttentionFacts:
    """What one attention layer passes to the attention function, learned once by the engine's probe forward.

    ``scale`` is the module's ``scaling`` (``head_dim ** -0.5`` where it passes none); ``head_dim`` the query
    and key head size, ``value_dim`` the value head size (they differ in multi-head latent attention).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_dim: int
    scale: float
    sliding_window: int | None = None
    softcap: float | None = None


class Attention:
    """One decoder layer's paged attention for one engine: its pool tensors, settings and the engine's backend.

    Args:
        layer_idx: The layer's index (its module's ``layer_idx``).
        k_cache: The layer's key pool ``[num_blocks, block_size, num_kv_heads, row]``.
        v_cache: The layer's value pool, same shape.
        facts: The layer's settings, read once (:class:`AttentionFacts`).
        backend: The engine's attention backend.
    """

    __slots__ = ("layer_idx", "k_cache", "v_cache", "facts", "backend", "scale", "sliding_window", "softcap",
                 "_pad_to", "_cut_to")

    def __init__(
        self, layer_idx: int, k_cache: torch.Tensor, v_cache: torch.Tensor, facts: AttentionFacts,
        backend: AttentionBackend,
    ) -> None:
        self.layer_idx = layer_idx
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.facts = facts
        self.backend = backend
        self.scale = facts.scale
        self.sliding_window = facts.sliding_window
        self.softcap = facts.softcap
        # Multi-head latent attention: the pool holds K and V at the larger head size. Zero columns in q and k
        # leave every score unchanged; zero columns in v only add output columns, cut off after the kernel.
        pool_dim = max(facts.head_dim, facts.value_dim)
        self._pad_to = pool_dim if facts.head_dim != facts.value_dim else 0
        self._cut_to = facts.value_dim if self._pad_to and facts.value_dim != pool_dim else 0

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, Dv]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, Dv]
        """Store this step's keys and values in the layer's pool and attend over each sequence's cache."""
        return self.attend(q, k, v, meta, self.scale, self.sliding_window, self.softcap)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
        sliding_window: int | None, softcap: float | None,
    ) -> torch.Tensor:
        """As calling the layer, with the settings given (the fused CPU layers pass their own)."""
        if self._pad_to:
            q, k, v = (torch.nn.functional.pad(x, (0, self._pad_to - x.shape[-1])) for x in (q, k, v))
        out = meta.impl(meta, self, q, k, v, scale, sliding_window, softcap)
        return out[..., : self._cut_to] if self._cut_to else out

    def __repr__(self) -> str:
        f = self.facts
        return (f"Attention(layer {self.layer_idx}, {f.num_heads} heads / {f.num_kv_heads} KV heads of {f.head_dim}, "
                f"window {f.sliding_window}, softcap {f.softcap}, backend {self.backend.name!r})")


class AttentionLayers(Sequence[Attention]):
    """Every attention layer of one model over one KV pool, for one engine; indexed by ``layer_idx``.

    Args:
        kv_caches: The pool's per-layer ``(k_cache, v_cache)`` (kept: the native decode program checks a step
            runs over its pool by this list's identity).
        facts: Each layer's :class:`AttentionFacts`, in layer order.
        backend: The engine's attention backend.
    """

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], facts: Sequence[AttentionFacts | None],
                 backend: AttentionBackend) -> None:
        if len(facts) != len(kv_caches) or any(f is None for f in facts):
            raise ValueError(f"expected the attention settings of each of the pool's {len(kv_caches)} layers "
                             "(a pool built from probe_kv_layout), got none for some")
        self.kv_caches = kv_caches
        self.backend = backend
        self._layers = [Attention(i, k, v, f, backend) for i, ((k, v), f) in enumerate(zip(kv_caches, facts))]

    @classmethod
    def for_pool(cls, pool, backend: AttentionBackend) -> AttentionLayers:
        """The layers of a :class:`~hf_paged.executor.kv_pool.KVPool` (its specs carry each layer's settings)."""
        return cls(pool.kv_caches, [spec.attention for spec in pool.specs], backend)

    def __getitem__(self, layer_idx):
        return self._layers[layer_idx]

    def __len__(self) -> int:
        return len(self._layers)

    def clear(self) -> None:
        """Drop every layer and its pool tensors (the engine closed: the pool's memory can go)."""
        self._layers = []
