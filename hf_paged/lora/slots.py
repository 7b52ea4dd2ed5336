"""LoRA slots: per adapted linear, the resident adapters' A and B stacked (vLLM-style), and the step's deltas.

A slot is the callable an engine linear calls after its own matmul: ``y = slot(x, y)`` adds, to each row
(token) of the step, the delta of that row's adapter, ``scale * (x @ A.T) @ B.T``, and nothing to base rows
(in place: ``y`` is the layer's fresh output, or a column view of its group GEMM's output).
Rows are grouped by adapter (the step's :class:`StepPlan`) and each group costs one pair of matmuls
(punica's segmented GEMM in plain torch); rows of one sequence are contiguous, so a group that is one run
of rows is a view, not a gather.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from hf_paged.lora.loading import LoRALayerWeights


@dataclass
class StepPlan:
    """The step's adapter rows, grouped by adapter slot (base rows are in no group).

    ``rows`` lists the adapter rows sorted by slot (stable: batch order within a slot), as a slice where that is
    one run of rows; ``segments`` are the slots' runs within it. A slot gathers the rows once, runs one pair of
    matmuls per segment, and adds the deltas back in one scatter.
    """

    num_tokens: int
    rows: slice | torch.Tensor | None  # None: ``segments`` are runs of the batch itself (no gather, no scatter)
    segments: list[tuple[int, int, int]]  # (slot index, start, end) within ``rows``, or within the batch
    # the thread running the step's forward: engines on one model share its layer objects, and another engine's
    # forward in another thread must not pick up this step's slots
    thread: int = field(default_factory=threading.get_ident)

    @property
    def num_rows(self) -> int:
        return self.segments[-1][2]


MAX_RUNS = 8  # up to this many runs of adapter rows (prefill chunks), each run is a segment in place


def plan_step(token_slots: list[int], device: torch.device) -> StepPlan | None:
    """Group rows by slot (``-1``: base). None when no row has an adapter: the slots then cost nothing.

    A sequence's rows are contiguous, so a step of a few long runs (prefill chunks) computes each run in place;
    a step of many short ones (decodes) gathers the rows sorted by slot and scatters the deltas back once.
    """
    runs: list[tuple[int, int, int]] = []
    for row, slot in enumerate(token_slots):
        if slot < 0:
            continue
        if runs and runs[-1][0] == slot and runs[-1][2] == row:
            runs[-1] = (slot, runs[-1][1], row + 1)
        else:
            runs.append((slot, row, row + 1))
    if not runs:
        return None
    if len(runs) <= MAX_RUNS:
        return StepPlan(len(token_slots), None, runs)
    order = sorted((slot, row) for row, slot in enumerate(token_slots) if slot >= 0)
    if not order:
        return None
    segments: list[tuple[int, int, int]] = []
    for i, (slot, _) in enumerate(order):
        if segments and segments[-1][0] == slot:
            segments[-1] = (slot, segments[-1][1], i + 1)
        else:
            segments.append((slot, i, i + 1))
    members = [row for _, row in order]
    if members[-1] - members[0] + 1 == len(members) and members == list(range(members[0], members[-1] + 1)):
        rows: slice | torch.Tensor = slice(members[0], members[-1] + 1)
    else:
        rows = torch.tensor(members, dtype=torch.long, device=device)
    return StepPlan(len(token_slots), rows, segments)


class LoRASlot:
    """The resident adapters of one linear: ``A [max_loras, max_rank, in]`` and ``B [max_loras, out, max_rank]``
    (zero past each adapter's rank), each slot's rank and scale. Tensors are made when an adapter of this
    linear first becomes resident.

    Args:
        plan_source: An object whose ``plan`` attribute is the current :class:`StepPlan` or None (the manager).
        in_features, out_features: The linear's sizes.
        max_loras, max_rank: Slots and the padded rank.
        device, dtype: Where and how the stacked weights are kept (the linear's device and float dtype).
    """

    def __init__(self, plan_source, in_features: int, out_features: int, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self._source = plan_source
        self.in_features, self.out_features = in_features, out_features
        self.max_loras, self.max_rank = max_loras, max_rank
        self.device, self.dtype = device, dtype
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.ranks = [0] * max_loras  # 0: the adapter in this slot leaves this linear alone
        self.scales = [0.0] * max_loras

    def set(self, slot: int, weights: LoRALayerWeights | None) -> None:
        """Make ``slot`` hold ``weights`` for this linear (None: the slot's adapter does not adapt it)."""
        if weights is None:
            self.ranks[slot], self.scales[slot] = 0, 0.0
            return
        if self.a is None:
            self.a = torch.zeros(self.max_loras, self.max_rank, self.in_features, device=self.device, dtype=self.dtype)
            self.b = torch.zeros(self.max_loras, self.out_features, self.max_rank, device=self.device, dtype=self.dtype)
        r = weights.rank
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.a[slot, :r].copy_(weights.a)
        self.b[slot, :, :r].copy_(weights.b)
        self.ranks[slot], self.scales[slot] = r, weights.scale

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` ``[..., out]`` plus each row's adapter delta from ``x`` ``[..., in]`` (the same rows)."""
        plan: StepPlan | None = self._source.plan
        if plan is None or self.a is None or plan.thread != threading.get_ident():
            return y
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] != plan.num_tokens:
            return y  # a forward over other rows (a draft model's, a probe): it runs the base model
        if not any(self.ranks[slot] for slot, _, _ in plan.segments):
            return y  # none of this step's adapters adapts this layer
        rows = plan.rows
        if rows is None:
            return self._runs(x2, y, plan.segments)
        # a slice is a view; index_select gathers in one copy (advanced indexing is far slower on CPU)
        xs = (x2[rows] if isinstance(rows, slice) else x2.index_select(0, rows)).to(self.dtype)
        skipped = any(not self.ranks[slot] for slot, _, _ in plan.segments)
        delta = (torch.zeros if skipped else torch.empty)(plan.num_rows, self.out_features, device=xs.device,
                                                          dtype=self.dtype)
        for slot, start, end in plan.segments:
            r = self.ranks[slot]
            if r:  # PEFT's order: (B(Ax)) * scale, then added
                torch.mm(torch.mm(xs[start:end], self.a[slot, :r].t()), self.b[slot, :, :r].t(), out=delta[start:end])
                delta[start:end].mul_(self.scales[slot])
        out = y.reshape(-1, self.out_features)
        if torch.is_grad_enabled() and y.requires_grad:  # else y is the layer's fresh output: added in place
            out = out.clone()
        delta = delta.to(out.dtype)
        if isinstance(rows, slice):
            out[rows] += delta
        else:
            out.index_add_(0, rows, delta)
        return out.view(y.shape)

    def _runs(self, x2: torch.Tensor, y: torch.Tensor, runs: list[tuple[int, int, int]]) -> torch.Tensor:
        """The deltas of a few runs of rows, each computed and added in place (views: no gather, no scatter)."""
        out = y.reshape(-1, self.out_features)
        if torch.is_grad_enabled() and y.requires_grad:
            out = out.clone()
        for slot, start, end in runs:
            r = self.ranks[slot]
            if r:
                delta = torch.mm(torch.mm(x2[start:end].to(self.dtype), self.a[slot, :r].t()), self.b[slot, :, :r].t())
                out[start:end] += delta.mul_(self.scales[slot]).to(out.dtype)
        return out.view(y.shape)
