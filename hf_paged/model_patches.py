"""What engines change on a model, shared and reference-counted per model.

Several engines (or a ``wrap`` plus an engine of one's own) may serve one model object. The attention
switch and the packed linears are taken by the first engine and given back by the last ``close()``:
closing one engine never pulls the attention implementation from under another, which would make it
generate wrong tokens silently.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_paged import attention


@dataclass
class _Patches:
    attention_refs: int = 0
    previous_attn: str = "sdpa"
    packed: object = None  # PackedLinears | None
    packing_refs: int = 0


_PATCHES: weakref.WeakKeyDictionary[torch.nn.Module, _Patches] = weakref.WeakKeyDictionary()
_lock = threading.RLock()


def acquire_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to the "hf_paged" attention (first holder) and count this holder."""
    with _lock:
        patches = _PATCHES.setdefault(model, _Patches())
        if patches.attention_refs == 0:
            patches.previous_attn = attention.enable(model)
        elif not attention_active(model):
            # switched away behind the holders' back (their steps now refuse to run): switch back
            attention.enable(model)
        patches.attention_refs += 1


def release_attention(model: torch.nn.Module) -> None:
    """Drop one holder; the last one gives the model its original attention implementation back."""
    with _lock:
        patches = _PATCHES.get(model)
        if patches is None or patches.attention_refs == 0:
            return
        patches.attention_refs -= 1
        if patches.attention_refs == 0:
            attention.disable(model, patches.previous_attn)


def acquire_packing(model: torch.nn.Module, make: Callable[[], object]):
    """The model's packed linears, made by ``make`` for the first holder and shared after."""
    with _lock:
        patches = _PATCHES.setdefault(model, _Patches())
        if patches.packing_refs == 0:
            patches.packed = make()
        if patches.packed is not None:
            patches.packing_refs += 1
        return patches.packed


def release_packing(model: torch.nn.Module) -> None:
    with _lock:
        patches = _PATCHES.get(model)
        if patches is None or patches.packing_refs == 0:
            return
        patches.packing_refs -= 1
        if patches.packing_refs == 0 and patches.packed is not None:
            patches.packed.remove()
            patches.packed = None


def num_holders(model: torch.nn.Module) -> int:
    with _lock:
        patches = _PATCHES.get(model)
        return 0 if patches is None else patches.attention_refs


def attention_active(model: torch.nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == attention.ATTN_IMPLEMENTATION
