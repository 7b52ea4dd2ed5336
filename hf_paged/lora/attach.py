"""Where the slots go: the engine's linear layer objects (:func:`hf_paged.model.layers.linear.engine_linears`).

Every engine linear ends its forward with ``y = self.lora(x, y)`` where ``lora`` is set. The manager sets it
only on the layers that the step's adapters adapt, and only for that step's forward
(:meth:`~hf_paged.lora.manager.LoRAManager.set_step`), to the layer's shared hook
(:class:`~hf_paged.lora.hooks.LayerHook`), which runs the slot of the manager stepping in the calling thread:
so several engines with adapters may share one model, even stepping at once in different threads. Between
adapter steps every ``lora`` is None, so a base-only step runs exactly as without LoRA (the native decode
program and decode buckets, which refuse an unknown ``lora``, keep serving those steps). The native decode
program serves adapter steps with delta ops it records, the decode buckets (static, CUDA graphs) with every
linear holding adapter tensors hooked for their replay
(:meth:`~hf_paged.lora.manager.LoRAManager.begin_static_step`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_paged.lora.loading import REFUSED_TARGETS
from hf_paged.lora.manager import LoRAManager
from hf_paged.model.layers.linear import engine_linears


def adaptable_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The linears a LoRA adapter may target: qualified name -> engine linear layer, those inside the decoder
    layers (never the embeddings or the LM head). A linear with hooks of its own stays a stock ``nn.Linear``
    (no slot) and is not listed."""
    # a PEFT model's own LoRA layer holds the linear as ``base_layer``: the adapter files name the outer module
    named = ((name.removesuffix(".base_layer"), m) for name, m in engine_linears(model))
    return {name: m for name, m in named
            if ".layers." in f".{name}" and not any(r in name.split(".")[-1] for r in REFUSED_TARGETS)}


def attach_slots(model: torch.nn.Module, manager: LoRAManager) -> Callable[[], None]:
    """Give ``manager`` the engine linear layers of ``model`` whose ``lora`` it sets per step; returns the undo.
    Several engines with adapters may attach to one model (they share its layer objects): each step sets the
    layers' shared hooks (:mod:`hf_paged.lora.hooks`), which run the slots of the manager stepping in the calling
    thread only."""
    manager.bind(adaptable_linears(model))

    def detach() -> None:
        manager.clear_step()
        manager.bind({})

    return detach
