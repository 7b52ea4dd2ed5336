"""Quantized linears in the native decode program (:mod:`hf_paged.executor.native_program`).

:func:`quant_group` joins sibling :class:`~hf_paged.model.layers.quant_linear.QuantLinear` projections that read the
same input (q/k/v, gate/up) into one QuantLinear over their concatenated rows, the members' ``qweight`` then
being views of it (no second copy of the bytes; each output row is computed as it was, so the results are
bitwise those of the separate calls). :class:`QuantOp` is one program call: the layer's kernel (its
``activations`` mode) straight on the step's buffers, or, for float activations and batches above
:data:`~hf_paged.model.layers.quant_linear.TILED_ROWS` rows, the module's own forward (dequantize and ``F.linear``), as
the eager forward does.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from hf_paged.executor.program_ops import c_call
from hf_paged.model.layers.quant_linear import FORMATS, TILED_ROWS, QuantEmbedding, QuantLinear, native_library

_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # parent -> {names: (members, group)}


def is_quantized(module: torch.nn.Module) -> bool:
    return type(module) in (QuantLinear, QuantEmbedding)


def quant_group(parent: torch.nn.Module, names: tuple[str, ...]) -> QuantLinear | None:
    """``parent``'s QuantLinear children ``names`` as one QuantLinear (built once, then kept while the members
    and their bytes stay the same), or None where they cannot be one: not all QuantLinear, or different formats,
    input widths, or int8 scales."""
    members = [getattr(parent, n, None) for n in names]
    if any(type(m) is not QuantLinear for m in members):
        return None
    cached = _groups.setdefault(parent, {}).get(names)
    if cached is not None:
        old, group, ptrs = cached
        if all(a is b for a, b in zip(old, members)) and [m.qweight.data_ptr() for m in members] == ptrs and all(
            m.activations == group.activations for m in members
        ):
            return group
    first = members[0]
    if any(m.fmt != first.fmt or m.in_features != first.in_features or m.activations != first.activations
           for m in members):
        return None
    qweight = torch.cat([m.qweight for m in members])
    scales = None if first.scales is None else torch.cat([m.scales for m in members])
    bias = None
    if any(m.bias is not None for m in members):
        bias = torch.cat([m.bias.detach() if m.bias is not None else torch.zeros(m.out_features) for m in members])
    group = QuantLinear(first.in_features, qweight.shape[0], first.fmt, qweight, scales, bias, first.activations)
    group.sizes = [m.out_features for m in members]
    row = 0
    for m in members:  # the members read the group's bytes: one copy of the weights
        m.qweight = group.qweight[row : row + m.out_features]
        if scales is not None:
            m.scales = group.scales[row : row + m.out_features]
        row += m.out_features
    _groups[parent][names] = (members, group, [m.qweight.data_ptr() for m in members])
    return group


class QuantOp:
    """``y[:rows] = layer(x[:rows, :K])`` for a program step, ``rows`` read from a ctypes cell at each call."""

    __name__ = "quantized linear"

    def __init__(self, layer: QuantLinear, x: torch.Tensor, x_stride: int, y: torch.Tensor, rows: ctypes.c_int,
                 threads: int) -> None:
        fn, mode, weight = layer.kernel()
        assert fn is not None, "QuantOp needs the native quantized kernel"
        if x.dtype == torch.bfloat16:  # a bf16 model's buffers: the bf16 mode's bf16-in, bf16-out kernel
            assert mode == "bf16" and y.dtype == torch.bfloat16, "bf16 buffers need the bf16 kernel mode"
            fn = native_library("bf16").hfqb_linear_bf16
        self.limit = TILED_ROWS if mode == "float" else None  # int8, bf16 activations: one kernel for every batch
        self.layer, self.x, self.y, self.rows = layer, x, y, rows
        scales = None if layer.scales is None else layer.scales.data_ptr()
        bias = None if layer.bias is None else layer.bias.data_ptr()
        self.weight = weight  # held: the interleaved copy of the rows8 kernel lives as long as the op
        args = (x.data_ptr(), x_stride, weight.data_ptr(), FORMATS[layer.fmt], scales, bias, y.data_ptr(), y.shape[1],
                rows, layer.out_features, layer.in_features, threads)
        limit = self.limit  # the C call, for steps of at most limit rows (program_ops.CallLists)
        self.direct = (fn, args, None if limit is None else lambda rows: rows <= limit)
        # the C call with its arguments converted once, the row count read from the cell (program_ops.c_call)
        self._call, self._call_args = c_call(fn, args)

    def __call__(self) -> int:
        if self.limit is None or self.rows.value <= self.limit:
            return self._call(*self._call_args)
        n = self.rows.value
        self.y[:n, : self.layer.out_features].copy_(self.layer(self.x[:n, : self.layer.in_features]))
        return 0
