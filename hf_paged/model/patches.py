"""What engines change on a model, shared and reference-counted per model.

Several engines (or a ``wrap`` plus an engine of one's own) may serve one model object. The attention
switch, the packed linears and the fused layers are taken by the first engine and given back by the last
``close()``:
closing one engine never pulls the attention implementation from under another, which would make it
generate wrong tokens silently.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hf_paged.attention import function as attention


@dataclass
class _Patches:
    attention_refs: int = 0
    previous_attn: str = "sdpa"
    shared: dict = field(default_factory=dict)  # name -> [object with remove(), holders]


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


def acquire(model: torch.nn.Module, name: str, make: Callable[[], object]):
    """The model's shared patch ``name`` (packed linears, fused layers), made by ``make`` for the first holder
    and shared after. A patch that changed nothing (empty: ``len`` 0) is removed again and None returned,
    holding nothing."""
    with _lock:
        patches = _PATCHES.setdefault(model, _Patches())
        entry = patches.shared.get(name)
        if entry is None:
            obj = make()
            if not obj:
                obj.remove()
                return None
            entry = patches.shared[name] = [obj, 0]
        entry[1] += 1
        return entry[0]


def release(model: torch.nn.Module, name: str) -> None:
    """Drop one holder of patch ``name``; the last one undoes it (``remove()``)."""
    with _lock:
        patches = _PATCHES.get(model)
        entry = None if patches is None else patches.shared.get(name)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del patches.shared[name]
            entry[0].remove()


def current(model: torch.nn.Module, name: str):
    """The model's live shared patch ``name``, or None (read without the lock: one dict lookup per call)."""
    patches = _PATCHES.get(model)
    entry = None if patches is None else patches.shared.get(name)
    return None if entry is None else entry[0]


def num_holders(model: torch.nn.Module) -> int:
    with _lock:
        patches = _PATCHES.get(model)
        return 0 if patches is None else patches.attention_refs


def attention_active(model: torch.nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == attention.ATTN_IMPLEMENTATION
