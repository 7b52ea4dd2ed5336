"""LoRA slots: per adapted linear, the resident adapters' A and B stacked (vLLM-style), and the step's deltas.

A slot is the callable an engine linear calls after its own matmul: ``y = slot(x, y)`` adds, to each row
(token) of the step, the delta of that row's adapter, ``scale * (x @ A.T) @ B.T``, and nothing to base rows
(in place: ``y`` is the layer's fresh output, or a column view of its group GEMM's output).
Rows are grouped by adapter (the step's :class:`StepPlan`, made once per step) in one of four layouts:

- ``"tokens"`` (CUDA, and every decode-bucket step): no grouping; each row's slot in one int32 tensor
  (``token_index``, ``-1``: a base row), and per linear one shrink and one expand kernel
  (:func:`hf_paged.kernels.lora.add_lora_delta`: Triton on CUDA; on CPU the C kernel below) read it, no gather, no
  scatter. Their grids depend on the row count only, so a CUDA graph replays them with the index in a static
  buffer (the decode buckets' ``lora_index``);
- ``"runs"``: a few long runs of rows (prefill chunks, batch 1): each run's delta is computed and added on views
  of ``x`` and ``y`` (no gather, no scatter);
- ``"padded"``: many short runs (decode steps mixing adapters): the rows are gathered once, sorted by slot and
  padded to ``[slots, longest segment, in]``, and every slot's delta is two batched matmuls (``bmm`` over the
  stacked A and B, zero past each adapter's rank) and one scale per row (0 on padding), scattered back in one
  ``index_add_``: five torch calls per linear whatever the number of adapters;
- ``"segments"``: the rows gathered once, a pair of matmuls per slot (when padding would waste too much).

On the CPU, for fp32 and bf16 slots, every layout is one call of our C kernel instead
(:mod:`hf_paged.kernels.cpu.lora_ops`, "bgmv": per token, its slot's ``A`` then ``B``, only to the slot's
rank): it reads the step's per-token slot index (:attr:`StepPlan.token_slot`, made once per step), the batch
rows themselves (no gather) and adds into ``y`` in place; the torch layouts above serve other dtypes and builds
without the kernel.

:meth:`StepPlan.inputs` and :meth:`LoRASlot.add_delta` split the gather from the rest, so a caller whose
linears share an input (the native decode program's q/k/v and gate/up groups) gathers it once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from hf_paged.kernels.cpu import lora_ops
from hf_paged.kernels.lora import add_lora_delta
from hf_paged.lora.loading import LoRALayerWeights

MAX_RUNS = 8  # up to this many runs of adapter rows may be computed in place ...
RUN_ROWS = 16  # ... when they are this long on average (prefill chunks); else the rows are gathered


@dataclass
class StepPlan:
    """The step's adapter rows grouped by adapter slot (base rows are in no group); see the module docstring.

    ``segments`` are ``(slot, start, end)``: runs of the batch itself (``"runs"``), or of the gathered rows
    ``rows`` (sorted by slot, batch order within a slot). ``"padded"`` adds ``slots`` (the step's distinct
    slots, sorted), ``length`` (the longest segment), ``index`` (``[len(slots) * length]`` batch rows; a
    padding position repeats its segment's first row) and ``valid`` (1.0 per real position, 0.0 on padding).
    """

    num_tokens: int
    layout: str  # "runs", "padded" or "segments"
    segments: list[tuple[int, int, int]]
    rows: torch.Tensor | None = None  # "segments": the gathered batch rows
    slots: list[int] = field(default_factory=list)
    length: int = 0
    index: torch.Tensor | None = None
    valid: list[float] = field(default_factory=list)
    token_slots: list[int] = field(default_factory=list)
    token_index: torch.Tensor | None = None  # "tokens": each row's slot on the device (-1: base or padding)
    static: bool = False
    backend: str = "auto"  # the "tokens" layout's kernels (hf_paged.kernels.lora): "auto", "torch" or "triton"
    # CPU steps: int32 [num_tokens], each row's slot (-1: base), for the C kernel (None on other devices)
    token_slot: torch.Tensor | None = None
    _scales: dict = field(default_factory=dict, repr=False)
    # the thread running the step's forward: engines on one model share its layer objects, and another engine's
    # forward in another thread must not pick up this step's slots
    thread: int = field(default_factory=threading.get_ident)

    @property
    def num_rows(self) -> int:
        return self.segments[-1][2]

    def kernel(self, dtype: torch.dtype) -> bool:
        """Whether slots of ``dtype`` add this step's deltas with the CPU kernel (then every layout reads the
        batch rows as they are)."""
        # CPU plans only (their slots have bt); a tokens plan with a backend asked for by name runs that one
        return (self.token_slot is not None and kernel_ok(dtype)
                and (self.layout != "tokens" or self.backend == "auto"))

    def inputs(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What :meth:`LoRASlot.add_delta` reads for the step's rows of ``x2`` ``[num_tokens, in]``: ``x2``
        itself (runs, or the CPU kernel), its gathered rows (segments) or ``[slots, length, in]`` (padded), in
        ``dtype``; ``x2`` as it is for the per-token kernels (tokens), which read any float dtype."""
        if self.kernel(dtype):
            return x2.to(dtype)
        if self.layout == "tokens":  # the kernels read x as it is
            return x2
        return self.torch_inputs(x2, dtype)

    def torch_inputs(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`inputs` as the torch layouts read them (whether or not the kernel serves the step)."""
        if self.layout == "runs":
            return x2.to(dtype)
        # index_select gathers in one copy (advanced indexing is far slower on CPU)
        rows = x2.index_select(0, self.index if self.layout == "padded" else self.rows).to(dtype)
        return rows.view(len(self.slots), self.length, -1) if self.layout == "padded" else rows

    def row_scales(self, scales: list[float], dtype: torch.dtype) -> torch.Tensor:
        """``[slots, length, 1]``: each padded position's adapter scale for a linear whose slots have ``scales``
        (0 on padding), made once per step for each distinct set of scales."""
        key = (dtype, tuple(scales[s] for s in self.slots))
        t = self._scales.get(key)
        if t is None:
            per = [key[1][i // self.length] * v for i, v in enumerate(self.valid)]
            t = self._scales[key] = torch.tensor(per, dtype=dtype, device=self.index.device).view(
                len(self.slots), self.length, 1)
        return t


USE_KERNEL = True  # False: the torch layouts on the CPU too (to compare the two)


def kernel_ok(dtype: torch.dtype) -> bool:
    """Whether the CPU LoRA kernel serves slots of ``dtype`` (built and probed here, :data:`USE_KERNEL`)."""
    return USE_KERNEL and lora_ops.available(dtype)


def plan_step(token_slots: list[int], device: torch.device, per_token: bool | None = None,
              backend: str = "auto") -> StepPlan | None:
    """Group rows by slot (``-1``: base). None when no row has an adapter: the slots then cost nothing.
    ``per_token`` (default: on CUDA) makes a ``"tokens"`` plan, whose kernels run on ``backend``; a CPU plan
    also carries the per-row slots for the C kernel (``token_slot``)."""
    plan = _plan_layout(token_slots, device, per_token, backend)
    if plan is not None and torch.device(device).type == "cpu":
        plan.token_slot = torch.tensor(token_slots, dtype=torch.int32)
    return plan


def _plan_layout(token_slots: list[int], device: torch.device, per_token: bool | None,
                 backend: str) -> StepPlan | None:
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
    num_tokens = len(token_slots)
    if per_token if per_token is not None else device.type == "cuda":
        index = torch.tensor(token_slots, dtype=torch.int32).to(device, non_blocking=True)
        return StepPlan(num_tokens, "tokens", runs, token_slots=list(token_slots), token_index=index,
                        backend=backend)
    adapter_rows = sum(end - start for _, start, end in runs)
    if len(runs) == 1 or (len(runs) <= MAX_RUNS and adapter_rows >= RUN_ROWS * len(runs)):
        return StepPlan(num_tokens, "runs", runs, token_slots=list(token_slots))
    order = sorted((slot, row) for row, slot in enumerate(token_slots) if slot >= 0)
    segments: list[tuple[int, int, int]] = []
    for i, (slot, _) in enumerate(order):
        if segments and segments[-1][0] == slot:
            segments[-1] = (slot, segments[-1][1], i + 1)
        else:
            segments.append((slot, i, i + 1))
    members = [row for _, row in order]
    length = max(end - start for _, start, end in segments)
    if len(segments) * length > 2 * adapter_rows + 8:  # padding would cost more than the rows themselves
        return StepPlan(num_tokens, "segments", segments, rows=torch.tensor(members, dtype=torch.long, device=device),
                        token_slots=list(token_slots))
    index, valid = [], []
    for _, start, end in segments:
        pad = length - (end - start)
        index += members[start:end] + [members[start]] * pad
        valid += [1.0] * (end - start) + [0.0] * pad
    return StepPlan(num_tokens, "padded", segments, slots=[s for s, _, _ in segments], length=length,
                    index=torch.tensor(index, dtype=torch.long, device=device), valid=valid,
                    token_slots=list(token_slots))


class LoRASlot:
    """The resident adapters of one linear: ``A [max_loras, max_rank, in]`` and ``B [max_loras, out, max_rank]``
    (zero past each adapter's rank, and all zero in a slot whose adapter leaves this linear alone), each slot's
    rank and scale (also as ``scale_t``, fp32 ``[max_loras]`` on the device, for the kernels). The tensors are
    made when an adapter of this linear first becomes resident, and from then on only written in place (a CUDA
    graph that captured them stays valid; the manager's :attr:`~hf_paged.lora.manager.LoRAManager.generation`
    counts the slots that have them).

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
        self.scale_t: torch.Tensor | None = None  # the scales on the device, for the Triton kernels
        # on the CPU B is stored transposed, bt [max_loras, max_rank, out] (the kernel's layout), and ``b`` is a
        # view of it: one copy of the weights for both paths
        self.bt: torch.Tensor | None = None
        self.ranks = [0] * max_loras  # 0: the adapter in this slot leaves this linear alone
        self.scales = [0.0] * max_loras
        # the same as tensors the C kernel reads (updated in place: a recorded call keeps their addresses)
        self.ranks_t = torch.zeros(max_loras, dtype=torch.int32)
        self.scales_t = torch.zeros(max_loras, dtype=torch.float32)

    def set(self, slot: int, weights: LoRALayerWeights | None) -> None:
        """Make ``slot`` hold ``weights`` for this linear (None: the slot's adapter does not adapt it)."""
        # the stacked tensors are made inside a step (inference mode) and changed outside it too (remove_lora)
        with torch.inference_mode():
            self._set(slot, weights)

    def _set(self, slot: int, weights: LoRALayerWeights | None) -> None:
        if weights is None:
            self.ranks[slot], self.scales[slot] = 0, 0.0
            self.ranks_t[slot], self.scales_t[slot] = 0, 0.0
            if self.a is not None:  # zeros: the padded layout runs every step's slots through one bmm
                self.a[slot].zero_()
                self.b[slot].zero_()
                self.scale_t[slot] = 0.0
            return
        if self.a is None:
            self.a = torch.zeros(self.max_loras, self.max_rank, self.in_features, device=self.device, dtype=self.dtype)
            if torch.device(self.device).type == "cpu":
                self.bt = torch.zeros(self.max_loras, self.max_rank, self.out_features, dtype=self.dtype)
                self.b = self.bt.transpose(1, 2)
            else:
                self.b = torch.zeros(self.max_loras, self.out_features, self.max_rank, device=self.device,
                                     dtype=self.dtype)
            self.scale_t = (self.scales_t if torch.device(self.device).type == "cpu"
                            else torch.zeros(self.max_loras, device=self.device, dtype=torch.float32))
        r = weights.rank
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.a[slot, :r].copy_(weights.a)
        self.b[slot, :, :r].copy_(weights.b)
        self.ranks[slot], self.scales[slot] = r, weights.scale
        self.ranks_t[slot], self.scales_t[slot] = r, weights.scale
        self.scale_t[slot] = weights.scale

    def active(self, plan: StepPlan | None) -> bool:
        """Whether this step adds anything here: a plan, and one of its adapters adapts this linear (a static plan:
        this linear has adapter tensors, the kernels run whatever the rows' slots)."""
        if plan is None or self.a is None or plan.thread != threading.get_ident():
            return False
        return plan.static or any(self.ranks[slot] for slot, _, _ in plan.segments)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` ``[..., out]`` plus each row's adapter delta from ``x`` ``[..., in]`` (the same rows)."""
        plan: StepPlan | None = self._source.plan
        if not self.active(plan):
            return y
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] != plan.num_tokens:
            return y  # a forward over other rows (a draft model's, a probe): it runs the base model
        out = y.reshape(-1, self.out_features)
        if torch.is_grad_enabled() and (y.requires_grad or x.requires_grad):
            # a forward that keeps a graph (the C kernel has no backward): torch ops on a copy of y
            out = out.clone()
            if plan.layout == "tokens":
                add_lora_delta(x2, self.a, self.b, self.scale_t, plan.token_index, out, "torch", checked=True)
            else:
                self._torch_delta(plan, plan.torch_inputs(x2, self.dtype), out)
            return out.view(y.shape)
        self.add_delta(plan, plan.inputs(x2, self.dtype), out)  # y is the layer's fresh output: added in place
        return out.view(y.shape)

    def add_delta(self, plan: StepPlan, xs: torch.Tensor, out: torch.Tensor) -> None:
        """Add the step's deltas into ``out`` ``[num_tokens, out]`` (in place; a column view is fine), from
        ``xs = plan.inputs(x2, self.dtype)``. The caller checked :meth:`active`."""
        if plan.kernel(self.dtype):
            self._kernel_delta(plan, xs, out)
        elif plan.layout == "tokens":  # one shrink, one expand over the per-token slot index
            add_lora_delta(xs, self.a, self.b, self.scale_t, plan.token_index, out, plan.backend, checked=True)
        else:
            self._torch_delta(plan, xs, out)

    def _kernel_delta(self, plan: StepPlan, xs: torch.Tensor, out: torch.Tensor) -> None:
        # one C call for every row of the step (xs: the batch rows, not gathered)
        direct = out.dtype == self.dtype and out.stride(-1) == 1
        y = out if direct else torch.zeros(out.shape, dtype=self.dtype)
        if xs.stride(-1) != 1:
            xs = xs.contiguous()
        lora_ops.call(y, xs, self.a, self.bt, plan.token_slot, self.scales_t, self.ranks_t, torch.get_num_threads())
        if not direct:
            out += y.to(out.dtype)

    def _torch_delta(self, plan: StepPlan, xs: torch.Tensor, out: torch.Tensor) -> None:
        # xs: plan.torch_inputs(...); dtypes the C kernel does not take, or no C compiler
        if plan.layout == "runs":
            for slot, start, end in plan.segments:
                r = self.ranks[slot]
                if r:  # PEFT's order: (B(Ax)) * scale, then added
                    delta = torch.mm(torch.mm(xs[start:end], self.a[slot, :r].t()), self.b[slot, :, :r].t())
                    out[start:end] += delta.mul_(self.scales[slot]).to(out.dtype)
            return
        if plan.layout == "padded":
            slots = plan.slots
            if slots == list(range(self.max_loras)):  # every slot in use: the stacked tensors themselves
                a, b = self.a, self.b
            else:
                which = torch.tensor(slots, device=self.a.device)
                a, b = self.a.index_select(0, which), self.b.index_select(0, which)
            delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2))
            delta.mul_(plan.row_scales(self.scales, delta.dtype))
            out.index_add_(0, plan.index, delta.view(-1, self.out_features).to(out.dtype))
            return
        skipped = any(not self.ranks[slot] for slot, _, _ in plan.segments)
        delta = (torch.zeros if skipped else torch.empty)(plan.num_rows, self.out_features, device=xs.device,
                                                          dtype=self.dtype)
        for slot, start, end in plan.segments:
            r = self.ranks[slot]
            if r:
                torch.mm(torch.mm(xs[start:end], self.a[slot, :r].t()), self.b[slot, :, :r].t(), out=delta[start:end])
                delta[start:end].mul_(self.scales[slot])
        out.index_add_(0, plan.rows, delta.to(out.dtype))
