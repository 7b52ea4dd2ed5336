"""The Python ops of the native decode program's call list (:mod:`hf_paged.executor.native_program`): steps that are
not one C call (another packing's ``linear``, a copy, a tensor-parallel collective, the LoRA deltas the C kernel
does not take). Each is a callable of no arguments reading the step's row count from a shared ``ctypes`` cell.
:func:`lora_delta_ops` makes a projection group's LoRA ops: C calls of the CPU LoRA kernel where it serves."""

from __future__ import annotations

import ctypes

import torch

from hf_paged.kernels.cpu import call_list, fused_ops, lora_ops
from hf_paged.lora import slots as lora_slots
from hf_paged.model.layers.parallel import ParallelLinear


def lora_delta_ops(manager, x: torch.Tensor, targets: list, rows: ctypes.c_int, token_slot: ctypes.c_void_p,
                   threads: int) -> list:
    """The ops adding the LoRA deltas of ``targets`` (``(slot, y)``: a member's slot and its output columns) from
    their shared input ``x``: per slot the CPU kernel takes, one C call (``hfp_lora_bgmv_call`` over the slot's
    stacked A and transposed B, reading the step's per-token slot index from the ``token_slot`` cell and the row
    count from ``rows``, a few us at batch 1); one :class:`Delta` for the others. A slot without tensors yet (no adapter of it
    resident) gets no op: the program watches its ``a`` and records again once it has one."""
    calls, rest = [], []
    for slot, y in targets:
        if slot.a is None:
            continue
        if not (slot.dtype == x.dtype == y.dtype and x.device.type == "cpu" and lora_slots.kernel_ok(slot.dtype)):
            rest.append((slot, y))
            continue
        calls.append(lora_ops.replay_call(x[:, : slot.in_features], y, slot.a, slot.bt, slot.scales_t, slot.ranks_t,
                                          threads, token_slot, rows))
    return calls + ([(Delta(manager, x, rest, rows), ())] if rest else [])


class Linear:
    """A packed linear the program runs through its own ``linear`` (packings other than the native GEMM):
    ``y[:rows] = pack.linear(x[:rows, :in], bias)``, the call the eager forward makes, into the step buffer."""

    __name__ = "linear"

    def __init__(self, pack, bias, x: torch.Tensor, y: torch.Tensor, rows: ctypes.c_int) -> None:
        self.pack, self.bias, self.x, self.y, self.rows = pack, bias, x, y, rows
        self.in_features = pack.source.shape[1]  # every packing keeps the weight it packed

    def __call__(self) -> None:
        n = self.rows.value
        self.y[:n].copy_(self.pack.linear(self.x[:n, : self.in_features], self.bias))


class Delta:
    """The LoRA deltas of linears sharing the input ``x`` (a group's members, or one projection): with the step's
    plan set, ``x[:rows]`` gathered once as the plan lays it out, then each member slot's deltas added into its
    output buffer ``y[:rows]`` (a column view of the group's output), as the slot adds them in the eager forward."""

    __name__ = "lora_delta"

    def __init__(self, manager, x: torch.Tensor, targets: list, rows: ctypes.c_int) -> None:
        self.manager, self.x, self.targets, self.rows = manager, x, targets, rows

    def __call__(self) -> None:
        plan = self.manager.plan
        active = [(slot, y) for slot, y in self.targets if slot.active(plan)]
        if not active:
            return
        n = self.rows.value
        xs = plan.inputs(self.x[:n], active[0][0].dtype)
        for slot, y in active:
            slot.add_delta(plan, xs if slot.dtype == active[0][0].dtype else plan.inputs(self.x[:n], slot.dtype), y[:n])


class Copy:
    """``dst[:rows] = src[:rows]``: a decoder layer's output copied out of the residual buffer."""

    __name__ = "copy"

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, rows: ctypes.c_int) -> None:
        self.src, self.dst, self.rows = src, dst, rows

    def __call__(self) -> None:
        n = self.rows.value
        self.dst[:n].copy_(self.src[:n])


class Finish:
    """A tensor-parallel layer's collective on its step buffer: ``layer.finish(y[:rows])`` (the all-reduce of a
    row-parallel projection, in place; the LM head's gather, into ``out`` on rank 0), as its forward runs it."""

    __name__ = "finish"

    def __init__(self, layer: ParallelLinear, y: torch.Tensor, rows: ctypes.c_int, out: torch.Tensor | None = None) -> None:
        self.layer, self.y, self.rows, self.out = layer, y, rows, out

    def __call__(self) -> None:
        n = self.rows.value
        done = self.layer.finish(self.y[:n])
        if self.out is not None and self.layer.rank == 0:
            self.out[:n].copy_(done)


class CallLists:
    """A recorded step's calls (``(fn, args)`` pairs, the LM head's GEMM at ``head``) ready to replay, every run of C
    calls made one (:func:`~hf_paged.kernels.cpu.call_list.join`), the calls left converted by :func:`c_call`.
    An op with a ``direct`` attribute ``(fn, args, serves)`` (a quantized linear, the fp32 SiLU-mul) is its C call
    ``fn(*args)`` in the joined calls of a step where ``serves(rows)`` (None: always), else the op itself, between
    runs: :meth:`pick` joins the calls once per pattern of which ops serve (:attr:`joined`: all of them)."""

    def __init__(self, ops: list, head: int) -> None:
        self.head = head
        self.kept = ops  # the arguments point into what the ops hold
        self._direct = [getattr(fn, "direct", None) for fn, _ in ops]
        self._checked = [i for i, d in enumerate(self._direct) if d is not None and d[2] is not None]
        self._by_served: dict[frozenset, tuple[list, int]] = {}
        self._by_rows: dict[int, tuple[list, int]] = {}
        self.joined, self.joined_head = self._joined(frozenset(self._checked))

    def _joined(self, served: frozenset) -> tuple[list, int]:
        got = self._by_served.get(served)
        if got is None:
            raw = [(d[0], d[1]) if d is not None and (d[2] is None or i in served) else op
                   for i, (op, d) in enumerate(zip(self.kept, self._direct))]
            calls, where = call_list.join(raw, frozenset({self.head}), convert=c_call)
            got = self._by_served[served] = (calls, where[self.head])
        return got

    def pick(self, rows: int) -> tuple[list, int]:
        """The calls for a step of ``rows`` rows and the index of its LM head's."""
        got = self._by_rows.get(rows)
        if got is None:
            served = frozenset(i for i in self._checked if self._direct[i][2](rows))
            got = self._by_rows[rows] = self._joined(served)
        return got


class SiluMul:
    """The MLP's ``gate = silu(gate) * up`` in place on rows of the step's gate|up buffer, as the fused forward
    computes it (:func:`~hf_paged.kernels.cpu.fused_ops.silu_mul_`); its C call is :attr:`direct` where the C pass
    serves (``fused_ops.silu_mul_kernel``; in fp32 for the row counts ``fused_ops.silu_f32_serves``)."""

    __name__ = "silu_mul"

    def __init__(self, gate_up: torch.Tensor, inter: int, rows: ctypes.c_int, threads: int) -> None:
        self.gate_up, self.inter, self.rows = gate_up, inter, rows
        self.direct = None
        kernel = fused_ops.silu_mul_kernel(gate_up.dtype)
        if kernel is not None:
            ptr, width = gate_up.data_ptr(), gate_up.shape[1]
            serves = None if gate_up.dtype != torch.float32 else lambda n: fused_ops.silu_f32_serves(n, inter, threads)
            self.direct = (kernel, (ptr, width, ptr + inter * gate_up.element_size(), width, rows, inter, threads), serves)

    def __call__(self) -> None:
        n = self.rows.value
        fused_ops.silu_mul_(self.gate_up[:n, : self.inter], self.gate_up[:n, self.inter :])


def c_call(fn, args: tuple) -> tuple:
    """``(twin, converted args)`` of a C function with ``argtypes``, else ``(fn, args)``: its arguments converted to
    ``ctypes`` values once, as its ``argtypes`` would convert them at each call, and the function called through a
    twin without ``argtypes`` (same address, same ``restype``): ``ctypes`` then passes the values as they are. The
    step's cells (``c_int`` and ``c_void_p`` objects the program sets before a replay) stay themselves, so a call
    still reads their current values, and any other ``ctypes`` object passes as it is. A 15-argument call took 4.1
    us instead of 5.9 on a Zen 3."""
    types = getattr(fn, "argtypes", None) if isinstance(fn, ctypes._CFuncPtr) else None
    if not types or len(types) != len(args):
        return fn, args
    try:
        converted = tuple(a if isinstance(a, _CTYPES) else t(a) for t, a in zip(types, args))
    except TypeError:  # an argument only argtypes knows how to pass: the call keeps them
        return fn, args
    twin = type(fn)(ctypes.cast(fn, ctypes.c_void_p).value)
    twin.restype, twin.__name__ = fn.restype, fn.__name__
    return twin, converted


# values ctypes passes without argtypes: its scalars and cells, arrays, structures, pointers, byref() objects
_CTYPES = (ctypes._SimpleCData, ctypes.Array, ctypes.Structure, ctypes.Union, ctypes._Pointer,
           type(ctypes.byref(ctypes.c_int())))
