"""``LoRARequest``: which adapter a request runs with (plain data: no torch, so every layer may hold one)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter for a request (vLLM's name and fields).

    Args:
        lora_name: A name for the adapter (the server's ``model`` field picks adapters by it).
        lora_int_id: A positive int, unique per adapter in an engine: the engine keys its caches by it, and
            it is part of the prefix-cache hash, so KV computed under one adapter never serves another.
        lora_path: A local PEFT folder (``adapter_config.json`` and ``adapter_model.safetensors`` or ``.bin``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise TypeError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise TypeError(f"lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise TypeError(f"lora_path must be a non-empty str (a local PEFT folder), got {self.lora_path!r}")
