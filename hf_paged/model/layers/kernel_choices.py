"""Tensor-parallel ranks run the kernels rank 0 chose.

Some kernel choices are timed at start, in each process alone (:mod:`hf_paged.kernels.cpu.tuning_store` keeps the
timings): on a busy host two ranks of one engine could pick differently, and then a shard's numbers would depend on
which rank timed what, run to run. Where a choice is made at a point every rank reaches together, it is broadcast
there (the packing kind per dtype in :class:`~hf_paged.model.layers.packed.PackedLinears`, the quantized activation
mode in :class:`~hf_paged.model.layers.quantize.QuantizedLinears`). The others are decided once per process and
first asked for during a forward or a recording; :func:`agree` decides them all at start, for the layers the shard
has, and every rank takes rank 0's:

- whether the C SiLU-mul serves, per dtype (:func:`hf_paged.kernels.cpu.fused_ops.silu_mul_kernel`);
- the int8 mode's weight layout per weight family (:func:`hf_paged.model.layers.quant_layout.rows8_chosen`);
- the fp32 packing under the upcast packing of bf16/fp16 weights (:func:`~hf_paged.kernels.cpu.packed_linear.upcast_inner_kind`).
"""

from __future__ import annotations

import logging

import torch

from hf_paged.kernels.cpu import fused_ops, packed_linear
from hf_paged.model.layers import quant_layout
from hf_paged.model.layers.linear import DenseLinear
from hf_paged.model.layers.parallel import is_shard, rank0_value
from hf_paged.model.layers.quant_linear import QuantLinear, kernel, native_library

logger = logging.getLogger(__name__)


def decide(model: torch.nn.Module) -> dict:
    """This process's choices for ``model``'s layers, each made now where it is not yet (timing it): the SiLU-mul
    for the dtypes of the model's floating-point parameters (its activations'), the int8 layout per weight family
    its int8-mode layers have, upcast's fp32 packing if it has such layers."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    for dtype in fused_ops.SILU_DTYPES:
        if dtype in dtypes:
            fused_ops.silu_mul_kernel(dtype)
    seen = set()
    upcast = None
    for m in model.modules():
        if type(m) is QuantLinear and (m.fmt, m.activations) not in seen:
            seen.add((m.fmt, m.activations))
            if kernel(m.activations)[1] == "int8":
                quant_layout.rows8_chosen(m.fmt, native_library("int8"))
        elif type(m) is DenseLinear and upcast is None and getattr(m.packer, "kind", None) == "upcast":
            upcast = packed_linear.upcast_inner_kind(tuple(m.weight.shape))
    return {"silu": fused_ops.silu_choices(), "layout": quant_layout.layout_choices(), "upcast": upcast}


def adopt(choices: dict) -> None:
    """Make ``choices`` (:func:`decide`'s, in another process) this process's."""
    fused_ops.adopt_silu_choices(choices["silu"])
    quant_layout.adopt_layout_choices(choices["layout"])
    if choices["upcast"] is not None:
        packed_linear.adopt_upcast_inner(choices["upcast"])


def agree(model: torch.nn.Module) -> dict | None:
    """On a tensor-parallel shard (every rank calls this at the same point of its start, after its layers are
    quantized and packed and before any forward), decide the choices and take rank 0's; the choices in effect.
    None (nothing done) for a model that is not a shard."""
    if not is_shard(model):
        return None
    mine = decide(model)
    chosen = rank0_value(mine)
    if chosen != mine:
        logger.info("kernel choices timed here %s; running rank 0's %s", mine, chosen)
        adopt(chosen)
    return chosen
