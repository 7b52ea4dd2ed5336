"""Where the slots go: the engine's linear layer objects (:func:`hf_paged.model.layers.linear.engine_linears`).

Every engine linear ends its forward with ``y = self.lora(x, y)`` where ``lora`` is set. The manager sets the
slot only on the layers that the step's adapters adapt, and only for that step's forward
(:meth:`~hf_paged.lora.manager.LoRAManager.set_step`): between adapter steps every ``lora`` is None, so a
base-only step runs exactly as without LoRA. The native decode program and the decode buckets serve adapter
steps too: the program with delta ops it records, the buckets (static, CUDA graphs) with every slot holding adapter
tensors set for their replay (:meth:`~hf_paged.lora.manager.LoRAManager.begin_static_step`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from hf_paged.lora.loading import REFUSED_TARGETS
from hf_paged.lora.manager import LoRAManager
from hf_paged.model.layers.linear import engine_linears

# model -> the manager whose slots its layers take (the layer objects are shared by the engines on a model)
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def adaptable_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The linears a LoRA adapter may target: qualified name -> engine linear layer, those inside the decoder
    layers (never the embeddings or the LM head). A linear with hooks of its own stays a stock ``nn.Linear``
    (no slot) and is not listed."""
    # a PEFT model's own LoRA layer holds the linear as ``base_layer``: the adapter files name the outer module
    named = ((name.removesuffix(".base_layer"), m) for name, m in engine_linears(model))
    return {name: m for name, m in named
            if ".layers." in f".{name}" and not any(r in name.split(".")[-1] for r in REFUSED_TARGETS)}


def attach_slots(model: torch.nn.Module, manager: LoRAManager) -> Callable[[], None]:
    """Give ``manager`` the engine linear layers of ``model`` whose ``lora`` it sets per step; returns the undo
    (every slot back to None). Raises ValueError if another engine serves adapters on the same model (the layer
    objects are shared by the engines on a model)."""
    owner = _OWNERS.get(model)
    if owner is not None and owner is not manager:
        raise ValueError("another engine on this model serves LoRA adapters (enable_lora); close it first, or give "
                         "this engine its own copy of the model")
    manager.bind(adaptable_linears(model))
    _OWNERS[model] = manager

    def detach() -> None:
        manager.clear_step()
        manager.bind({})
        if _OWNERS.get(model) is manager:
            del _OWNERS[model]

    return detach
