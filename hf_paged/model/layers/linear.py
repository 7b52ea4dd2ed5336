"""The linear layers an engine serves: one layer object per linear, owning its weight method and a LoRA slot.

At engine start :class:`OwnedLinears` replaces every plain ``nn.Linear`` of the model with a
:class:`DenseLinear`: a new module object that shares the original's parameter dict (the very ``weight`` and
``bias`` tensors, so ``state_dict`` keys, an optimizer's references and tied weights stay as they are). What a
layer computes is then decided by the layer object, once, at start:

- :class:`DenseLinear` (fp32/bf16/fp16): ``F.linear``, or on CPU inside engine forwards the packed weight the
  engine chose for its dtype (:mod:`hf_paged.model.layers.packed` sets :attr:`DenseLinear.packer`);
- :class:`~hf_paged.model.layers.quant_linear.QuantLinear` (int8, and the GGUF block formats q8_0/q4_0/q4_1): the engine
  quantizing at start swaps the ``DenseLinear`` for it; a GGUF model or ``quantize_model`` brings it already;
- a tensor-parallel rank's slice sits inside a :class:`~hf_paged.model.layers.parallel.ParallelLinear`, which
  runs the collective after it.

Every layer that computes (``DenseLinear`` and ``QuantLinear``) ends its forward with its **LoRA slot**:
``y = slot(x, y)`` where ``lora`` is set (``None``: no adapters, nothing runs). A slot is any callable
``slot(x [..., in], y [..., out]) -> y'`` that adds, per row of the step, that row's adapter delta (the
multi-LoRA manager sets them; a tensor-parallel slice's slot sees its slice's ``x`` and ``y``).
:func:`engine_linears` lists them with their qualified names (the name of the ``ParallelLinear`` for a slice).

:meth:`OwnedLinears.remove` (the last engine's ``close()``, or ``unwrap``) puts the original modules back where
the engine's are still in place. Modules with hooks of their own (accelerate's offloading hooks, a user's forward
hooks) are left alone: replacing them would drop the hooks.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F

from hf_paged.attention.function import engine_forward_active

logger = logging.getLogger(__name__)


class DenseLinear(torch.nn.Linear):
    """An engine's float linear (see the module docstring): ``F.linear`` on its own weight, or its packed weight
    inside engine forwards on CPU, then its LoRA slot. Made by :meth:`adopt`, never constructed directly."""

    packer = None  # makes this layer's packed weight (CPU); None: F.linear
    lora = None  # the LoRA slot: callable (x, y) -> y, or None
    _pack = None

    @classmethod
    def adopt(cls, linear: torch.nn.Linear) -> DenseLinear:
        """A ``DenseLinear`` sharing ``linear``'s parameters (its parameter dict itself: a weight replaced on
        either module is the other's too), hooks dicts and flags; ``linear`` is not changed."""
        layer = copy.copy(linear)  # a new object whose __dict__ holds the same _parameters dict
        layer.__class__ = cls
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x)
        slot = self.lora
        return y if slot is None else slot(x, y)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.packer is not None and engine_forward_active():
            weight = self.weight
            if x.dtype == weight.dtype and x.device.type == "cpu" and not (
                torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            ):
                pack = self.current_pack()
                if pack is not None:
                    return pack.linear(x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def current_pack(self):
        """The pack of the current weight (packed again if the weight changed since: an optimizer step,
        ``load_state_dict``, a replaced tensor), or None: no packing, or the weight no longer fits it (another
        dtype or device, or a tensor made under ``torch.inference_mode``, which has no version to watch)."""
        packer = self.packer
        if packer is None:
            return None
        weight = self.weight
        pack = self._pack
        if pack is None or pack.stale(weight):
            if weight.dtype != packer.dtype or weight.device.type != "cpu" or weight.is_inference():
                return None
            with torch.inference_mode(False):  # packed during an engine step: normal tensors, with versions
                pack = self._pack = packer(weight)
        return pack

    def set_packer(self, packer, pack_now: bool = True) -> None:
        """Use ``packer`` (a callable ``weight -> pack`` with a ``dtype`` attribute; None: plain ``F.linear``)."""
        self.packer = packer
        self._pack = None
        if packer is not None and pack_now:
            self.current_pack()

    def drop_pack(self) -> None:
        """Free this layer's own pack (a packed group holds its weight now); it packs again if called alone."""
        self._pack = None


def _own_hooks(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


class OwnedLinears:
    """Replaces every plain ``nn.Linear`` of ``model`` with a :class:`DenseLinear` (undone by :meth:`remove`).

    A tensor-parallel rank's slice (the ``base`` of a ``ParallelLinear``) is replaced like any other child.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._swapped: list[tuple[torch.nn.Module, str, torch.nn.Linear, DenseLinear]] = []
        kept = 0
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                if _own_hooks(child):
                    kept += 1
                    continue
                layer = DenseLinear.adopt(child)
                setattr(parent, name, layer)
                self._swapped.append((parent, name, child, layer))
        if kept:
            logger.info("%d linear layer(s) with hooks of their own stay stock nn.Linear (no packing, no LoRA slot)", kept)

    def __len__(self) -> int:
        return len(self._swapped)

    def remove(self) -> None:
        """Put the original modules back (where the engine's layer is still in place: a module the user set
        meanwhile stays)."""
        for parent, name, original, layer in reversed(self._swapped):
            layer.set_packer(None, pack_now=False)
            layer.lora = None
            if parent._modules.get(name) is layer:
                setattr(parent, name, original)
        self._swapped.clear()


def engine_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, layer)`` for every linear layer object of ``model`` that computes (``DenseLinear``,
    ``QuantLinear``): the objects whose ``lora`` slot a LoRA manager sets. A tensor-parallel slice is named as
    its ``ParallelLinear`` (``...o_proj``, not ``...o_proj.base``)."""
    from hf_paged.model.layers.quant_linear import QuantLinear
    from hf_paged.model.layers.parallel import ParallelLinear

    out = []
    for name, module in model.named_modules():
        if type(module) in (DenseLinear, QuantLinear):
            parent, _, leaf = name.rpartition(".")
            if leaf == "base" and type(model.get_submodule(parent)) is ParallelLinear:
                name = parent
            out.append((name, module))
    return out


def is_dense(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a float linear: a stock ``nn.Linear`` or the engine's :class:`DenseLinear`."""
    return type(module) in (torch.nn.Linear, DenseLinear)
