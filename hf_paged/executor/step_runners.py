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

    def __init__(self, scheduled: list[ScheduledSequence], pack: Callable[[list[ScheduledSequence]], StepInputs]) -> None:
        self.scheduled = scheduled
        self.sampled = [item for item in scheduled if item.sample]
        self._pack = pack
        self._inputs: StepInputs | None = None

    @property
    def inputs(self) -> StepInputs:
        if self._inputs is None:
            self._inputs = self._pack(self.scheduled)
        return self._inputs


class StepRunner(Protocol):
    def accepts(self, scheduled: list[ScheduledSequence]) -> bool:
        """Whether steps of this kind are this runner's (cheap; plain data only)."""

    def run(self, step: Step) -> torch.Tensor | None:
        """Logits ``[N, V]`` at the step's sampled rows, or None to leave the step to the eager runner."""


class EagerStepRunner:
    """The model's own forward (``paged_metadata`` in its keyword arguments), logits at the sampled rows only."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._logits_to_keep = _takes_logits_to_keep(model)

    def accepts(self, scheduled: list[ScheduledSequence]) -> bool:
        return True

    def run(self, step: Step) -> torch.Tensor:
        return self.forward(step.inputs)

    def forward(self, inputs: StepInputs, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Forward ``inputs`` through ``model`` (the target by default; a draft model shares the path)."""
        model = self.model if model is None else model
        kwargs = {METADATA_KWARG: inputs.metadata}
        keep = self._logits_to_keep if model is self.model else _takes_logits_to_keep(model)
        if keep:
            kwargs["logits_to_keep"] = inputs.logits_indices
        with engine_forward():
            output = model(input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False, **kwargs)
        logits = output.logits[0]
        if not keep:
            logits = logits.index_select(0, inputs.logits_indices)
        return logits


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters
