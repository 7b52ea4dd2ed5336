"""Quantize a model's decoder linears at engine start (``EngineConfig(quantization="int8" | "int4")``).

Every plain ``nn.Linear`` of the model but the LM head (its output embeddings) is swapped for a
:class:`~hf_paged.cpu.quant_linear.QuantLinear` of its weight: "int8" per output channel, "int4" in groups of
32 (scale and min, the Q4_1 layout). The LM head and the embeddings stay float. A linear whose input width is not
a multiple of 32 stays float too (one warning naming how many). The swap belongs to the model, shared by its
engines (:mod:`hf_paged.model_patches`), and :meth:`QuantizedLinears.remove` (the last engine's ``close()``)
puts the original modules back; they stay referenced meanwhile, so the float weights stay in memory.
"""

from __future__ import annotations

import logging

import torch

from hf_paged.cpu.quant_linear import GROUP, QUANTIZATIONS, QuantLinear

logger = logging.getLogger(__name__)


def check_quantization(name: object) -> None:
    """ValueError unless ``name`` is None or one of :data:`QUANTIZATIONS`."""
    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {sorted(QUANTIZATIONS)}, got {name!r}")


class QuantizedLinears:
    """The model's decoder linears swapped for quantized ones (see the module docstring).

    Args:
        model: The model, changed in place.
        quantization: "int8" or "int4".
    """

    def __init__(self, model: torch.nn.Module, quantization: str) -> None:
        check_quantization(quantization)
        self.quantization = quantization
        self._swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []  # (parent, name, original)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        unfit = []
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear or child is head:
                    continue
                if child.in_features % GROUP or child.weight.device.type != "cpu":
                    unfit.append(child)
                    continue
                setattr(parent, name, QuantLinear.from_linear(child, quantization))
                self._swapped.append((parent, name, child))
        if unfit:
            logger.warning(
                "quantization=%r: %d linear layer(s) stay float (input width not a multiple of the group size %d, "
                "or not on CPU), e.g. %s", quantization, len(unfit), GROUP, unfit[0],
            )
        logger.info("quantized %d linear layers to %s (%.1f MiB)", len(self._swapped), quantization,
                    sum(getattr(p, n).nbytes for p, n, _ in self._swapped) / 2**20)

    def __len__(self) -> int:
        return len(self._swapped)

    def remove(self) -> None:
        """Put the original float modules back."""
        for parent, name, original in reversed(self._swapped):
            setattr(parent, name, original)
        self._swapped.clear()
