"""Where the slots go: the base model's adaptable linears, and the one function that attaches the slots."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_paged.lora.loading import REFUSED_TARGETS
from hf_paged.lora.manager import LoRAManager


def adaptable_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The linears a LoRA adapter may target: module name -> module, the decoder layers' linears (never the
    embeddings or the LM head)."""
    try:  # the engine's own linear layer objects, where the model was loaded into them
        from hf_paged.model.layers.linear import engine_linears
    except ImportError:
        engine_linears = None
    if engine_linears is not None:
        found = dict(engine_linears(model))
    else:
        # plain, packed or quantized linears: whatever maps in_features to out_features
        found = {name: m for name, m in model.named_modules()
                 if isinstance(getattr(m, "in_features", None), int) and isinstance(getattr(m, "out_features", None), int)}
    return {name: m for name, m in found.items()
            if ".layers." in f".{name}" and not any(r in name.split(".")[-1] for r in REFUSED_TARGETS)}


def attach_slots(model: torch.nn.Module, manager: LoRAManager) -> Callable[[], None]:
    """Set ``module.lora`` to its slot on every adaptable linear of ``model``; returns the undo.

    An engine linear layer calls its ``lora`` after its matmul. A plain ``nn.Linear`` (a model not loaded into
    engine layers) does not: until every served linear is an engine layer, such a module gets a forward hook
    that calls its slot, the one place that wraps anything here.
    """
    modules = dict(model.named_modules())
    undo: list[Callable[[], None]] = []
    for name, slot in manager.slots.items():
        module = modules[name]
        module.lora = slot
        undo.append(lambda m=module: setattr(m, "lora", None))
        if not _calls_lora(module):
            handle = module.register_forward_hook(_slot_hook)
            undo.append(handle.remove)

    def detach() -> None:
        for step in reversed(undo):
            step()

    return detach


def _calls_lora(module: torch.nn.Module) -> bool:
    """Whether the module's own forward applies ``self.lora`` (an engine linear layer)."""
    return bool(getattr(type(module), "applies_lora", False))


def _slot_hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    slot = getattr(module, "lora", None)
    return output if slot is None else slot(args[0], output)
