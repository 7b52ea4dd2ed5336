"""Quantize a model's linears at engine start (``EngineConfig(quantization="int8" | "int4")``) and choose the
kernels' activation mode (``EngineConfig(quant_activations="float" | "int8" | "bf16" | "auto")``).

Every plain ``nn.Linear`` of the model is swapped for a :class:`~hf_paged.model.layers.quant_linear.QuantLinear` of its
weight: the decoder linears "int8" per output channel or "int4" in groups of 32 (scale and min, the Q4_1 layout);
the LM head (its output embeddings, read every step: 108 MiB in fp32 for the default model) as ``q8_0`` (blocks of
32 with an fp16 scale, GGUF's format for token embeddings) in both cases, unless ``lm_head=False``. The input
embeddings stay float (a lookup reads a few rows). A linear whose input width is not a multiple of 32 stays float
(one warning naming how many). With ``quant_activations="int8"`` (or ``"bf16"``) every ``QuantLinear`` of the
model (those just made and those a GGUF file brought) runs the int8- (or bf16-) activation kernels; ``"auto"`` picks
the fastest mode here (:mod:`hf_paged.model.layers.quant_modes`). The change belongs to the model, shared by
its engines (:mod:`hf_paged.model.patches`), and :meth:`QuantizedLinears.remove` (the last engine's ``close()``)
puts the original modules and modes back; the originals stay referenced meanwhile, so the float weights stay in
memory (the model is the caller's, and int8 weights could not give the same numbers back). :func:`quantize_model`
converts a model for good instead, dropping the float layers.
"""

from __future__ import annotations

import logging

import torch

from hf_paged.model.layers import quant_modes
from hf_paged.model.layers.quant_linear import ACTIVATIONS, GROUP, QUANTIZATIONS, QuantLinear
from hf_paged.model.layers.linear import is_dense
from hf_paged.model.layers.parallel import ParallelLinear, linear_of, rank0_choice

logger = logging.getLogger(__name__)

HEAD_FORMAT = "q8_0"
ACTIVATION_CHOICES = (*ACTIVATIONS, "auto")  # "auto": the fastest of ACTIVATIONS here, measured at start


def check_quantization(name: object, activations: object = "float") -> None:
    """ValueError unless ``name`` is None or one of :data:`QUANTIZATIONS` and ``activations`` one of
    :data:`ACTIVATION_CHOICES`."""
    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {sorted(QUANTIZATIONS)}, got {name!r}")
    if activations not in ACTIVATION_CHOICES:
        raise ValueError(f"quant_activations must be one of {ACTIVATION_CHOICES}, got {activations!r}")


class QuantizedLinears:
    """The model's linears swapped for quantized ones, and its quantized linears' activation mode (see the module
    docstring).

    Args:
        model: The model, changed in place.
        quantization: "int8", "int4", or None (only set the activation mode).
        activations: "float", "int8", "bf16", or "auto" (the fastest of them here for the model's commonest
            quantized layer in an engine of ``max_rows`` sequences; ``activations`` then holds the mode picked
            and ``requested`` says "auto").
        lm_head: Quantize the LM head too (as q8_0).
        max_rows: The most rows a linear gets per decode step (the engine's ``max_num_seqs``), for "auto".
    """

    def __init__(self, model: torch.nn.Module, quantization: str | None, activations: str = "float",
                 lm_head: bool = True, max_rows: int = 64) -> None:
        check_quantization(quantization, activations)
        self.quantization, self.requested = quantization, activations
        self._swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []  # (parent, name, original)
        self._modes: list[tuple[QuantLinear, str]] = []  # (layer, its mode before)
        if quantization is not None:
            self._swap(model, quantization, lm_head)
        self._auto = False  # "auto" picked a mode for quantized layers: held even where it changed nothing
        if activations == "auto":
            layer = quant_modes.representative_layer(model)
            self._auto = layer is not None
            activations = "float" if layer is None else quant_modes.fastest_mode(layer, max_rows)
            activations = rank0_choice(model, activations)  # a tensor-parallel shard runs rank 0's pick
            logger.info("quant_activations='auto' runs the %r mode here", activations)
        self.activations = activations
        for layer in model.modules():
            if type(layer) is QuantLinear and layer.activations != activations:
                self._modes.append((layer, layer.activations))
                layer.activations = activations

    def _swap(self, model: torch.nn.Module, quantization: str, lm_head: bool) -> None:
        # (a tensor-parallel shard's head is a ParallelLinear: its slice is the linear to quantize)
        head = linear_of(model.get_output_embeddings()) if hasattr(model, "get_output_embeddings") else None
        unfit = []
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if not is_dense(child) or (child is head and not lm_head):
                    continue
                fit = child.in_features % GROUP == 0 and child.weight.device.type == "cpu"
                shard = parent if type(parent) is ParallelLinear else None  # a tensor-parallel rank's slice
                if shard is not None:
                    fit = shard.agree(fit)  # every rank quantizes its slice, or none does
                if not fit:
                    unfit.append(child)
                    continue
                fmt = HEAD_FORMAT if child is head else quantization
                # int8 scales are per row: a row-parallel slice takes the whole row's (as one process has it)
                absmax = shard.row_absmax() if shard is not None and fmt == "int8" else None
                setattr(parent, name, QuantLinear.from_weight(child.weight, child.bias, fmt, row_absmax=absmax))
                self._swapped.append((parent, name, child))
        if unfit:
            logger.warning(
                "quantization=%r: %d linear layer(s) stay float (input width not a multiple of the group size %d, "
                "or not on CPU), e.g. %s", quantization, len(unfit), GROUP, unfit[0],
            )
        logger.info("quantized %d linear layers to %s (%.1f MiB)", len(self._swapped), quantization,
                    sum(getattr(p, n).nbytes for p, n, _ in self._swapped) / 2**20)

    def serves(self, quantization: str | None, activations: str) -> bool:
        """Whether an engine asking for ``quantization`` and ``activations`` can share these layers ("auto" takes
        the mode they run)."""
        return quantization == self.quantization and activations in (self.activations, "auto")

    def __len__(self) -> int:
        # "auto" is held even where it picked the mode the layers had, so that other engines share its pick
        return len(self._swapped) + len(self._modes) + self._auto + (
            self.quantization is None and self.activations != "float")

    def remove(self) -> None:
        """Put the original float modules and activation modes back."""
        for layer, mode in reversed(self._modes):
            layer.activations = mode
        self._modes.clear()
        for parent, name, original in reversed(self._swapped):
            setattr(parent, name, original)
        self._swapped.clear()


def quantize_model(model: torch.nn.Module, quantization: str, *, lm_head: bool = True) -> torch.nn.Module:
    """Quantize ``model``'s linears in place for good, as ``EngineConfig(quantization=...)`` does at start, but
    dropping the float layers: their weights are freed once nothing else holds them, and there is no way back.
    The float tensors that stay (embeddings, norms) are copied once, so that the memory-mapped checkpoint file
    (``from_pretrained``'s safetensors) is unmapped rather than kept resident by them.
    The model stays a stock ``transformers`` model (plain forward, ``generate``, ``wrap``, any number of engines,
    ``quant_activations`` per engine), like a GGUF model loaded with :func:`hf_paged.load_gguf`.

    Args:
        model: The model (on CPU), changed in place and returned.
        quantization: "int8" (per output channel) or "int4" (groups of 32 with a scale and a min, stored as q4_1).
        lm_head: Quantize the LM head too, as q8_0.

    Raises:
        ValueError: an unknown ``quantization``; a model an engine holds (close it first); a model already
            quantized (by an earlier call, or from a GGUF file); a model with no CPU ``nn.Linear`` to quantize.
    """
    from hf_paged.model import patches as model_patches

    if quantization is None or quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {sorted(QUANTIZATIONS)}, got {quantization!r}")
    if model_patches.num_holders(model):
        raise ValueError("quantize_model: an engine (or wrap) holds this model; close it first")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swapped = QuantizedLinears(model, quantization, "float", lm_head)
    for layer, mode in swapped._modes:  # quantized layers it found (a GGUF model's) keep their mode
        layer.activations = mode
    if not swapped._swapped:
        done = [m for m in model.modules() if isinstance(m, QuantLinear)]
        if done:  # quantize_model ran already (or the model came quantized, from a GGUF file)
            formats = ", ".join(sorted({m.fmt for m in done}))
            raise ValueError(f"quantize_model: the model is already quantized ({len(done)} quantized linear "
                             f"layers, {formats}) and has no float nn.Linear layer left; quantize the float model")
        raise ValueError(f"quantization={quantization!r}: the model has no CPU nn.Linear layer to quantize")
    if any(original is head for _, _, original in swapped._swapped) and getattr(model, "config", None) is not None:
        model.config.tie_word_embeddings = False  # the head is its own q8_0 bytes now: tie_weights() must not re-tie
    swapped._swapped.clear()  # the originals go with the last reference to them
    with torch.no_grad():  # the float tensors left (embeddings, norms) get their own memory, so that a memory-
        for t in [*model.parameters(), *model.buffers()]:  # mapped checkpoint they shared is unmapped
            if t.dtype.is_floating_point:
                t.data = t.data.clone()
    return model
