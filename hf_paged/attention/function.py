"""The ``"hf_paged"`` attention implementation registered in transformers' attention interfaces.

With an :class:`AttentionMetadata` in the ``paged_metadata`` keyword of the model's forward, every
attention layer writes the step's K/V into the paged pool and attends over it. Without it (a plain
``model(...)`` call, training) both the attention function and the mask function defer to the model's
original implementation ("sdpa" or "eager"), so wrapping never changes a normal forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING
from dataclasses import dataclass, field

import torch

from hf_paged.attention.layer import AttentionFacts

if TYPE_CHECKING:
    from hf_paged.attention.backends import StepAttention
    from hf_paged.attention.layer import AttentionLayers

ATTN_IMPLEMENTATION = "hf_paged"
METADATA_KWARG = "paged_metadata"

# True while the engine runs a forward: the mask function then returns None (the paged kernels mask by
# themselves). The metadata itself travels explicitly in the forward's keyword arguments; mask functions
# do not receive those, hence this flag.
_ENGINE_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_paged_engine_forward", default=False)

# id(config) -> the attention implementation the model had before it was switched to "hf_paged".
_ORIGINAL_IMPL: dict[int, str] = {}


@dataclass
class AttentionMetadata:
    """Everything a layer needs to store and attend for one step; built once per step, shared by layers.

    Shapes: ``slot_mapping [num_tokens]``, ``block_tables [num_seqs, max_blocks]`` (int32),
    ``seq_lens [num_seqs]``, ``cu_seqlens_q [num_seqs + 1]``. ``layers`` are the engine's attention layer
    objects (:mod:`hf_paged.attention.layer`: each layer's pool tensors and settings, built at engine start);
    ``impl`` is the backend's per-step work (:mod:`hf_paged.attention.backends`): which kernels run is
    decided there, once, not by flags here.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    layers: AttentionLayers  # the engine's Attention object of each layer, by layer_idx
    impl: StepAttention  # this step's store + attention, planned once by the engine's attention backend


@dataclass
class KVLayoutProbe:
    """Passed instead of metadata in one tiny forward to learn each layer's K/V shape and dtype.

    ``layers[i] = (num_kv_heads, head_dim, dtype)``, where head_dim is the larger of the key and value
    head sizes (they differ in multi-head latent attention: DeepSeek V2/V3, MiniCPM3), and ``facts[i]`` what
    the layer passes to the attention function (its scaling, window, softcap, head counts), which the
    engine's :class:`~hf_paged.attention.layer.Attention` objects then hold. It also notes what the paged
    kernels cannot serve: attention sinks, and layers that call the attention function more than once per
    forward (each call would overwrite the layer's one KV pool).
    """

    layers: dict[int, tuple[int, int, torch.dtype]] = field(default_factory=dict)
    facts: dict[int, AttentionFacts] = field(default_factory=dict)
    unindexed: int = 0
    calls: dict[int, int] = field(default_factory=dict)
    modules: dict[int, str] = field(default_factory=dict)  # layer_idx -> attention module class name
    sinks: set[str] = field(default_factory=set)  # class names of modules that pass attention sinks (s_aux)


@contextlib.contextmanager
def engine_forward() -> Iterator[None]:
    token = _ENGINE_FORWARD.set(True)
    try:
        yield
    finally:
        _ENGINE_FORWARD.reset(token)


def engine_forward_active() -> bool:
    return _ENGINE_FORWARD.get()


def _original_impl(config) -> str:
    return _ORIGINAL_IMPL.get(id(config), "sdpa")


def _fallback_attention(module: torch.nn.Module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = _original_impl(module.config)
    if impl == "eager":
        # "eager" is each model's own function (some add softcap or sinks), defined in its modeling file.
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise NotImplementedError(f"{type(module).__name__} has no eager_attention_forward to fall back to")
        return eager
    return ALL_ATTENTION_FUNCTIONS[impl]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, num_heads, q_len, head_dim]
    key: torch.Tensor,  # [batch, num_kv_heads, q_len, head_dim]
    value: torch.Tensor,  # [batch, num_kv_heads, q_len, head_dim]
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # [batch, q_len, num_heads, head_dim]
    meta = kwargs.get(METADATA_KWARG)
    if not isinstance(meta, AttentionMetadata):
        if isinstance(meta, KVLayoutProbe):
            _record_layout(meta, module, query, key, value, kwargs)
        kwargs.pop(METADATA_KWARG, None)
        return _fallback_attention(module)(module, query, key, value, attention_mask, **kwargs)

    if query.shape[0] != 1:
        raise ValueError(f"the paged engine packs a step into batch 1, got query batch {query.shape[0]}")
    # The layer's object holds its pool, settings and backend (built at engine start: the probe forward has
    # refused modules without layer_idx or with attention sinks, so nothing about the module is checked here).
    out = meta.layers[module.layer_idx](
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), meta
    )
    return out.unsqueeze(0), None


def attend(
    meta: AttentionMetadata,
    layer_idx: int,
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, Dv]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, H, Dv]
    """Store one layer's new keys and values in its pool and attend over each sequence's cache, with the
    settings given (callers that compute attention themselves, like the fused CPU layers)."""
    return meta.layers[layer_idx].attend(q, k, v, meta, scale, sliding_window, softcap)


def _record_layout(
    probe: KVLayoutProbe, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    kwargs: dict,
) -> None:
    if kwargs.get("s_aux") is not None:
        probe.sinks.add(type(module).__name__)
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        probe.unindexed += 1
        return
    assert key.shape[1] == value.shape[1], f"{type(module).__name__}: K and V head counts differ"
    probe.layers[layer_idx] = (key.shape[1], max(key.shape[-1], value.shape[-1]), key.dtype)
    scaling = kwargs.get("scaling")
    probe.facts[layer_idx] = AttentionFacts(
        num_heads=query.shape[1], num_kv_heads=key.shape[1], head_dim=key.shape[-1], value_dim=value.shape[-1],
        scale=query.shape[-1] ** -0.5 if scaling is None else float(scaling),
        sliding_window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"),
    )
    probe.calls[layer_idx] = probe.calls.get(layer_idx, 0) + 1
    probe.modules[layer_idx] = type(module).__name__


def paged_mask(*args, **kwargs):
    """Mask function of "hf_paged": none inside the engine, the original implementation's outside it."""
    if _ENGINE_FORWARD.get():
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config = kwargs.get("config")
    impl = _original_impl(config) if config is not None else "sdpa"
    return ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(impl, sdpa_mask)(*args, **kwargs)


def register() -> None:
    """Register "hf_paged" in transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_mask)


def check_supported(model: torch.nn.Module) -> None:
    cls = type(model)
    if not getattr(cls, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"{cls.__name__} does not support transformers' attention interface "
            "(_supports_attention_backend is False), which hf_paged plugs into; use a model class that does "
            "(Llama, Mistral, Qwen2, Gemma, ... in transformers >= 5)"
        )


def enable(model: torch.nn.Module) -> str:
    """Switch ``model`` to "hf_paged"; return the implementation it had (to restore with :func:`disable`)."""
    check_supported(model)
    register()
    previous = model.config._attn_implementation
    if previous == ATTN_IMPLEMENTATION:
        return _original_impl(model.config)
    fallback = previous if previous in ("sdpa", "eager") else "sdpa"
    for cfg in _configs(model):
        _ORIGINAL_IMPL[id(cfg)] = fallback
        weakref.finalize(cfg, _ORIGINAL_IMPL.pop, id(cfg), None)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return previous


def disable(model: torch.nn.Module, previous: str) -> None:
    if model.config._attn_implementation == ATTN_IMPLEMENTATION:
        model.set_attn_implementation(previous)


def _configs(model: torch.nn.Module) -> list:
    seen: dict[int, object] = {}
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen[id(cfg)] = cfg
    return list(seen.values())
