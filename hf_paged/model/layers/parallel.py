"""Linear layers the engine owns: a tensor-parallel shard's linear with its collective as part of the layer.

A tensor-parallel rank holds a slice of every sharded linear (:mod:`hf_paged.executor.tensor_parallel`). Where
a slice's output is not the layer's output, the layer itself finishes it:

- a **row-parallel** linear (o_proj, down_proj: the rank holds a slice of the input columns) adds the partial
  outputs of every rank: an all-reduce after its own linear;
- the **vocab-parallel** LM head (the rank holds a run of vocabulary rows) sends its rows of the logits to rank
  0, which puts them together (sampling happens there only).

Column-parallel linears (q/k/v, gate/up) need nothing after them: they stay plain linears of their slice.

:class:`ParallelLinear` is that layer: it wraps the rank's linear (``base``: an ``nn.Linear``, packed or not, or
a :class:`~hf_paged.model.layers.quant_linear.QuantLinear` once the engine quantizes it) and runs the collective after
it. Because the collective is part of the layer, and not a hook on a module, every way of computing the layer
keeps it: quantizing ``base`` at engine start (the quantizer swaps the child), packing it, the fused CPU decoder
layers (which call o_proj and down_proj as modules) and the native decode program (which runs ``base`` as a C
call and then :meth:`ParallelLinear.finish` on its step buffer). The model is the rank's private shard (built by
the rank, never a user's object), so nothing has to be given back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

REDUCE = ("sum", "gather")


@dataclass
class CommStats:
    """This process's time and bytes in the forward's collectives (all-reduces and the LM head's gather),
    including any wait for a slower rank: ``hf-paged bench chat --systems tp2`` reports it per step."""

    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0

    def add(self, started: float, tensor: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - started
        self.bytes += tensor.numel() * tensor.element_size()
        self.calls += 1


COMM = CommStats()


class ParallelLinear(torch.nn.Module):
    """One rank's slice of a sharded linear and the collective that completes it (see the module docstring).

    Args:
        base: The rank's linear: ``nn.Linear`` (or a module computing ``x @ W^T + b`` of its slice).
        reduce: "sum" (row-parallel: all-reduce the partial outputs) or "gather" (vocab-parallel LM head: rank 0
            gathers every rank's rows, concatenates them and drops the padding past ``out_features``).
        rank: This process's rank.
        world: The number of ranks.
        out_features: The full layer's output width (the vocabulary, for "gather"); the slice's own otherwise.
    """

    def __init__(self, base: torch.nn.Module, reduce: str, rank: int, world: int, out_features: int | None = None) -> None:
        super().__init__()
        if reduce not in REDUCE:
            raise ValueError(f"reduce must be one of {REDUCE}, got {reduce!r}")
        self.base = base
        self.reduce, self.rank, self.world = reduce, rank, world
        self.in_features = base.in_features
        self.out_features = out_features if out_features is not None else base.out_features

    def extra_repr(self) -> str:
        return f"reduce={self.reduce}, rank={self.rank}, world={self.world}, out_features={self.out_features}"

    @property
    def weight(self) -> torch.Tensor:
        """The slice's weight (a float ``base``'s; for code that reads ``lm_head.weight``'s dtype or device)."""
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.base(x))

    def finish(self, local: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's ``local`` output: summed over the ranks in place ("sum"), or
        (``"gather"``) the full logits on rank 0 and ``local`` on the others (nobody reads them)."""
        started = time.perf_counter()
        if self.reduce == "sum":
            dist.all_reduce(local)
            COMM.add(started, local)
            return local
        local = local.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(local) for _ in range(self.world)]
            dist.gather(local, parts, dst=0)
            COMM.add(started, local)
            return torch.cat(parts, dim=-1)[..., : self.out_features]
        dist.gather(local, None, dst=0)
        COMM.add(started, local)
        return local


    def agree(self, fit: bool) -> bool:
        """Whether every rank's slice of this layer ``fit``s something (all-reduce of the answer): the ranks must
        all change the layer or none, because a change may run collectives (:meth:`row_absmax`)."""
        return bool(agree_min(int(fit)))

    def row_absmax(self) -> torch.Tensor | None:
        """For a row-parallel layer, each output row's largest weight magnitude over every rank's columns (the
        scale of a per-row quantization, equal to the unsharded layer's); None for the LM head (whole rows)."""
        if self.reduce != "sum":
            return None
        absmax = self.base.weight.detach().abs().amax(dim=1).float()
        dist.all_reduce(absmax, op=dist.ReduceOp.MAX)
        return absmax


def is_shard(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a tensor-parallel shard: it has a :class:`ParallelLinear` and the process group is up."""
    return dist.is_initialized() and any(type(m) is ParallelLinear for m in model.modules())


def rank0_value(value):
    """``value`` as rank 0 has it (a broadcast in the default process group; every rank calls this together)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank0_choice(model: torch.nn.Module, value):
    """``value`` as rank 0 chose it, where ``model`` is a tensor-parallel shard (every rank calls this at the same
    point of its start): a choice timed on each rank (a kernel mode) could differ between ranks, and then so would
    the numbers. Else ``value`` itself."""
    return rank0_value(value) if is_shard(model) else value


def linear_of(module: torch.nn.Module) -> torch.nn.Module:
    """The module that computes ``module``'s linear: its ``base`` for a :class:`ParallelLinear`, else itself."""
    return module.base if type(module) is ParallelLinear else module


def agree_min(value: int) -> int:
    """The smallest of every rank's ``value`` (an all-reduce MIN in the default process group): how the ranks
    agree on a choice each made alone (a layer changed on all or none, a bucket built, a prefix found on disk)."""
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
