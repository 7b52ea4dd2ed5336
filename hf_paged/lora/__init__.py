"""Multi-LoRA: PEFT adapters loaded per request, mixed in one batch (docs/lora.md)."""

from hf_paged.lora.request import LoRARequest

__all__ = ["LoRARequest"]
