"""LoRA slots: per adapted linear, the resident adapters' A and B stacked (vLLM-style), and the step's deltas.

A slot is the callable an engine linear calls after its own matmul: ``y = slot(x, y)`` adds, to each row
(token) of the step, the delta of that row's adapter, ``scale * (x @ A.T) @ B.T``, and nothing to base rows.
Rows are grouped by adapter (the step's :class:`StepPlan`) and each group costs one pair of matmuls
(punica's segmented GEMM in plain torch); rows of one sequence are contiguous, so a group that is one run
of rows is a view, not a gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.lora.loading import LoRALayerWeights


@dataclass
class StepPlan:
    """The step's rows grouped by adapter slot (base rows appear in no group)."""

    num_tokens: int
    groups: list[tuple[int, slice | torch.Tensor]]  # (slot index, its rows: a slice or an index tensor)


def plan_step(token_slots: list[int], device: torch.device) -> StepPlan | None:
    """Group rows by slot (``-1``: base). None when no row has an adapter: the slots then cost nothing."""
    rows: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            rows.setdefault(slot, []).append(row)
    if not rows:
        return None
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for slot, members in sorted(rows.items()):
        if members[-1] - members[0] + 1 == len(members):
            groups.append((slot, slice(members[0], members[-1] + 1)))
        else:
            groups.append((slot, torch.tensor(members, dtype=torch.long, device=device)))
    return StepPlan(len(token_slots), groups)


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
        if plan is None or self.a is None:
            return y
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] != plan.num_tokens:
            return y  # a forward over other rows (a draft model's, a probe): it runs the base model
        out: torch.Tensor | None = None
        for slot, rows in plan.groups:
            r = self.ranks[slot]
            if r == 0:
                continue
            if out is None:
                out = y.reshape(-1, self.out_features).clone()
            xs = x2[rows].to(self.dtype)
            delta = (xs @ self.a[slot, :r].t()) @ self.b[slot, :, :r].t()
            delta = delta.mul_(self.scales[slot]).to(out.dtype)
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
        return y if out is None else out.view(y.shape)
