"""The ``lora`` of an engine linear shared by several LoRA engines on one model.

The engines on a model share its linear layer objects (one ``lora`` attribute each), but every engine with
``enable_lora`` has its own :class:`~hf_paged.lora.manager.LoRAManager` (its own adapters and slots), and two
engines may step at once in two threads (a server's engine loop and a user's second ``PagedGenerator``). So a
layer never holds a manager's slot itself: while any manager's step needs the layer, its ``lora`` is the layer's
one :class:`LayerHook`, which hands the call to the slot of the manager whose step runs in the calling thread
(:func:`current_manager`), and to nobody in any other thread (a base forward of another engine, a draft model).
The hook counts the steps that need it: the last one to finish takes it off the layer, so between adapter steps
every ``lora`` is None again and base-only steps run exactly as without LoRA.
"""

from __future__ import annotations

import threading
import weakref

import torch

_LOCK = threading.Lock()  # guards every hook's count and the ``lora`` attribute it sets
_CURRENT = threading.local()  # .manager: the manager whose step runs in this thread
# layer object -> its hook (shared by every manager on the model; gone with the layer)
_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def current_manager():
    """The LoRA manager whose step's forward runs in the calling thread, or None."""
    return getattr(_CURRENT, "manager", None)


def set_current_manager(manager) -> object:
    """Make ``manager`` (or None) the calling thread's current one; returns the one it replaces."""
    previous = getattr(_CURRENT, "manager", None)
    _CURRENT.manager = manager
    return previous


class LayerHook:
    """One engine linear's ``lora`` while adapter steps need it: ``hook(x, y)`` is the current manager's slot for
    this layer applied to ``(x, y)``, or ``y`` unchanged (no step of a manager adapting it in this thread)."""

    __slots__ = ("_layer", "_users", "__weakref__")

    def __init__(self, layer: torch.nn.Module) -> None:
        self._layer = weakref.ref(layer)  # the hook is the value of a weak map keyed by the layer
        self._users = 0  # steps (of any manager, any thread) that have it on the layer now

    @property
    def layer(self) -> torch.nn.Module | None:
        return self._layer()

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        manager = current_manager()
        slot = None if manager is None else manager.slot_of_hook(self)
        return y if slot is None else slot(x, y)

    def enter(self) -> None:
        """A step needs this layer: the hook goes on it (if it is not there yet)."""
        with _LOCK:
            layer = self._layer()
            if layer is None:
                return
            self._users += 1
            layer.lora = self

    def leave(self) -> None:
        """That step is over: the last step to leave takes the hook off the layer."""
        with _LOCK:
            self._users = max(0, self._users - 1)
            layer = self._layer()
            if self._users == 0 and layer is not None and layer.lora is self:
                layer.lora = None


def hook_of(layer: torch.nn.Module) -> LayerHook:
    """The one hook of ``layer`` (made on first use, kept as long as the layer)."""
    with _LOCK:
        hook = _HOOKS.get(layer)
        if hook is None:
            hook = _HOOKS[layer] = LayerHook(layer)
        return hook
