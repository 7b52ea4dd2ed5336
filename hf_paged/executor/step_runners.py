"""Step runners: what runs a step's forward. The model runner owns the eager one and at most one fast one,
both chosen once at start (:func:`hf_paged.executor.setup.make_fast_runner`), and picks between them per step
by its kind (``accepts``):

- :class:`EagerStepRunner`: the model's own HF forward over the packed ragged batch; serves every step.
- :class:`~hf_paged.executor.decode_buckets.DecodeBuckets`: uniform decode steps padded into buckets and
  replayed as CUDA graphs, inductor graphs or static eager forwards.
- :class:`~hf_paged.executor.native_program.DecodeProgram`: on CPU, steps whose sequences all take the native
  attention, replayed as the recorded list of C kernel calls.

A fast runner may still decline a step it accepted (``run`` returns None: a bucket failed to build, a module
hook the program would skip is registered); the eager runner then serves it.

Besides logits, a step may ask for **hidden states** (``Step.hidden_layers``: decoder layer indices; an EAGLE
draft head reads the target's): the runner that serves the step puts the output of each of those decoder layers
(the residual stream after the layer, before the final norm), ``[T, hidden]`` over all the step's rows, in
``Step.hidden``. The eager runner and the native program capture them in the same forward; the decode buckets
decline such steps (the eager runner serves them).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from hf_paged.attention.function import METADATA_KWARG, AttentionMetadata, engine_forward
from hf_paged.core.scheduler_output import ScheduledSequence


@dataclass
class StepInputs:
    """A step packed as one sequence of ``num_tokens`` tokens (shapes in brackets)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [N] rows of the step whose next token is sampled
    sampled: list[ScheduledSequence]  # the N sequences, in row order

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


class Step:
    """One scheduled step as step runners see it: the plain-data sequences, and their packed inputs built on
    first use (decode buckets pack into their own buffers and never build them)."""

    def __init__(self, scheduled: list[ScheduledSequence], pack: Callable[[list[ScheduledSequence]], StepInputs],
                 hidden_layers: tuple[int, ...] = ()) -> None:
        self.scheduled = scheduled
        self.sampled = [item for item in scheduled if item.sample]
        self._pack = pack
        self._inputs: StepInputs | None = None
        self.hidden_layers = hidden_layers  # decoder layers whose output the step's caller wants
        self.hidden: dict[int, torch.Tensor] = {}  # layer -> [T, hidden], filled by the runner that served it

    @property
    def inputs(self) -> StepInputs:
        if self._inputs is None:
            self._inputs = self._pack(self.scheduled)
        return self._inputs


class StepRunner(Protocol):
    def accepts(self, scheduled: list[ScheduledSequence]) -> bool:
        """Whether steps of this kind are this runner's (cheap; plain data only)."""

    def run(self, step: Step) -> torch.Tensor | None:
        """Logits ``[N, V]`` at the step's sampled rows (and ``step.hidden`` for ``step.hidden_layers``), or
        None to leave the step to the eager runner."""


class EagerStepRunner:
    """The model's own forward (``paged_metadata`` in its keyword arguments), logits at the sampled rows only."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._logits_to_keep = _takes_logits_to_keep(model)

    def accepts(self, scheduled: list[ScheduledSequence]) -> bool:
        return True

    def run(self, step: Step, model: torch.nn.Module | None = None) -> torch.Tensor:
        return self.forward(step.inputs, model, step.hidden_layers, step.hidden)

    def forward(self, inputs: StepInputs, model: torch.nn.Module | None = None, hidden_layers: tuple[int, ...] = (),
                hidden: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Forward ``inputs`` through ``model`` (the target by default; a draft model shares the path); the
        outputs of decoder layers ``hidden_layers`` go into ``hidden``."""
        model = self.model if model is None else model
        kwargs = {METADATA_KWARG: inputs.metadata}
        keep = self._logits_to_keep if model is self.model else _takes_logits_to_keep(model)
        if keep:
            kwargs["logits_to_keep"] = inputs.logits_indices
        handles = _capture(model, hidden_layers, hidden) if hidden_layers else ()
        try:
            with engine_forward():
                output = model(input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        logits = output.logits[0]
        if not keep:
            logits = logits.index_select(0, inputs.logits_indices)
        return logits


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM (``model.get_decoder().layers``), or ValueError naming what it lacks."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder 'layers' ModuleList to take hidden states from")
    return layers


def check_hidden_layers(model: torch.nn.Module, hidden_layers: tuple[int, ...]) -> tuple[int, ...]:
    """``hidden_layers`` as a sorted tuple of distinct decoder layer indices of ``model`` (ValueError otherwise)."""
    n = len(decoder_layers(model))
    bad = [i for i in hidden_layers if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n]
    if bad:
        raise ValueError(f"hidden layers {bad} are not decoder layer indices of this model (0..{n - 1})")
    return tuple(sorted(set(hidden_layers)))


def _capture(model: torch.nn.Module, hidden_layers: tuple[int, ...], hidden: dict[int, torch.Tensor]) -> list:
    """Forward hooks for this one forward that put decoder layer ``i``'s output ``[T, hidden]`` in ``hidden[i]``."""
    layers = decoder_layers(model)

    def keep(i: int):
        def hook(module, args, out):
            hidden[i] = (out[0] if isinstance(out, tuple) else out)[0]
        return hook

    return [layers[i].register_forward_hook(keep(i)) for i in hidden_layers]


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters
