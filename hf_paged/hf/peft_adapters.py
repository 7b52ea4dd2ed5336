"""``wrap`` on a PEFT model: its LoRA adapters served by the engine's multi-LoRA slots.

The engine runs over the PEFT model's base causal LM (``get_base_model()``), whose linears PEFT wrapped in its
own LoRA layers (``...q_proj`` holding ``...q_proj.base_layer``). Each PEFT adapter is saved once into a
temporary folder and added to the engine as a :class:`~hf_paged.LoRARequest` under its PEFT name; during the
engine's own forwards PEFT's layers are switched to their base layer (a pre/post hook pair), so the adapter
delta comes from the engine's slot of each row and never twice. A plain forward, or PEFT's own ``generate`` of
the unwrapped model, is unchanged.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hf_paged.attention.function import engine_forward_active
from hf_paged.lora.request import LoRARequest

BASE_NAME = "__base__"  # PEFT's adapter_names entry for a row without adapter
STATE_KEY = "_hf_paged_state"  # where wrap keeps its state in the model's __dict__


def adapters_of(model: torch.nn.Module) -> PeftAdapters | None:
    """The LoRA adapters of a wrapped PEFT model, or None."""
    state = model.__dict__.get(STATE_KEY)
    return getattr(state, "adapters", None)


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


@dataclass
class PeftAdapters:
    """The adapters of a wrapped PEFT model, by PEFT name, and how to undo what wrapping set."""

    model: torch.nn.Module  # the PeftModel
    requests: dict[str, LoRARequest]
    folder: str
    layers: list[torch.nn.Module]  # PEFT's LoRA layers (their flags tell whether adapters are disabled)
    undo: list[Callable[[], None]] = field(default_factory=list)

    @property
    def max_rank(self) -> int:
        return max((int(getattr(self.model.peft_config[name], "r", 8)) for name in self.requests), default=8)

    def row_requests(self, adapter_names: Sequence[str] | None, batch: int) -> list[LoRARequest | None]:
        """Each row's adapter: PEFT's ``adapter_names`` (``"__base__"``: none), else the active adapter (none
        while PEFT's adapters are disabled)."""
        if adapter_names is None:
            if any(layer._disable_adapters for layer in self.layers[:1]):  # inside PEFT's disable_adapter()
                return [None] * batch
            active = self.model.active_adapter
            return [self._request(active)] * batch
        if isinstance(adapter_names, str) or len(adapter_names) != batch:
            raise ValueError(f"adapter_names must list one adapter name per row ({batch} rows), got {adapter_names!r}")
        return [None if name == BASE_NAME else self._request(name) for name in adapter_names]

    def _request(self, name: str) -> LoRARequest:
        request = self.requests.get(name)
        if request is None:
            raise ValueError(f"unknown adapter {name!r}; this model's LoRA adapters are {sorted(self.requests)} "
                             f"(and {BASE_NAME!r} for the base model)")
        return request

    def close(self) -> None:
        for step in reversed(self.undo):
            step()
        self.undo.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


def export_adapters(model: torch.nn.Module) -> PeftAdapters:
    """Save every LoRA adapter of the PEFT ``model`` into a temporary folder and switch PEFT's LoRA layers to
    their base layer inside engine forwards. Raises NotImplementedError for what the engine cannot serve."""
    names = [name for name, cfg in model.peft_config.items() if str(getattr(cfg, "peft_type", "")).endswith("LORA")]
    if len(names) != len(model.peft_config):
        raise NotImplementedError(f"hf_paged.wrap serves PEFT LoRA adapters only; this model has "
                                  f"{ {n: str(c.peft_type) for n, c in model.peft_config.items()} }")
    layers = [m for m in model.get_base_model().modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    if any(getattr(m, "merged", False) for m in layers):
        raise NotImplementedError("hf_paged.wrap: the PEFT adapters are merged into the weights; unmerge_adapter() "
                                  "first (or wrap the merge_and_unload() model as a plain model)")
    folder = tempfile.mkdtemp(prefix="hf_paged_peft_")
    requests = {}
    try:
        for i, name in enumerate(names, start=1):
            model.save_pretrained(folder, selected_adapters=[name])
            path = folder if name == "default" else os.path.join(folder, name)
            requests[name] = LoRARequest(name, i, path)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    adapters = PeftAdapters(model, requests, folder, layers)
    for layer in layers:
        adapters.undo.append(layer.register_forward_pre_hook(_base_only_in_engine).remove)
        adapters.undo.append(layer.register_forward_hook(_restore_flag).remove)
    return adapters


def _base_only_in_engine(module: torch.nn.Module, args: tuple) -> None:
    module.__dict__["_hf_paged_flag"] = module._disable_adapters
    if engine_forward_active():
        module._disable_adapters = True  # the engine's slots add the adapters, per row


def _restore_flag(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
    module._disable_adapters = module.__dict__.pop("_hf_paged_flag", module._disable_adapters)
