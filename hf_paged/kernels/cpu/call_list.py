"""Runs of recorded C kernel calls made by one ctypes call (``csrc/call_list.c``).

The native decode program (:mod:`hf_paged.executor.native_program`) replays ~300 kernel calls a step, each a
ctypes call of 2-4 us on our hosts even with its arguments converted once (~1 ms of a 10-15 ms batch-1 step).
:func:`join` turns every run of consecutive C calls into one call of ``hfp_run_calls`` over an array of the
calls' addresses, signatures and arguments, leaving the other entries (Python ops, kernels of a signature the
runner does not know) as they were. The calls are the same, in the same order, with the same arguments: a
``ctypes`` scalar argument (the program's row count and step pointers) is passed as its address and read at
each run, as ctypes reads the cell's current value at each direct call. ``HF_PAGED_CALL_LIST=0`` keeps the
direct calls (for comparison).
"""

from __future__ import annotations

import ctypes
import os

from hf_paged.kernels.cpu.native import NativeLibrary

_i32, _ptr = ctypes.c_int, ctypes.c_void_p
LIBRARY = NativeLibrary(
    "call_list.c",
    {"hfp_call_signature": (ctypes.c_char_p, [_i32]), "hfp_call_max_args": (_i32, []), "hfp_call_size": (_i32, []),
     "hfp_run_calls": (_i32, [_ptr, _i32, _ptr])},
    what="the recorded call runner",
)
_LETTERS = {ctypes.c_void_p: "p", ctypes.c_int64: "l", ctypes.c_int: "i", ctypes.c_float: "f", None: "v"}
_CELL_SIZES = {"p": 8, "l": 8, "i": 4}  # the bytes the runner reads from a cell of that letter
# ctypes objects a pointer argument passes by their fixed address: arrays and byref() (a pointer object is left
# out: a direct call would pass what it points to at that call)
_BY_ADDRESS = (ctypes.Array, type(ctypes.byref(ctypes.c_int())))


class _Arg(ctypes.Union):
    _fields_ = [("i", ctypes.c_int64), ("f", ctypes.c_double)]


class _Runner:
    """The loaded library, its signature table and the ``hfp_call`` structure of its size."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.signatures: dict[str, int] = {}
        while (sig := lib.hfp_call_signature(len(self.signatures))) is not None:
            self.signatures[sig.decode()] = len(self.signatures)
        max_args = lib.hfp_call_max_args()

        class Call(ctypes.Structure):
            _fields_ = [("fn", ctypes.c_void_p), ("sig", ctypes.c_int32), ("cells", ctypes.c_uint32),
                        ("a", _Arg * max_args)]

        if ctypes.sizeof(Call) != lib.hfp_call_size():
            raise RuntimeError(f"hfp_call is {lib.hfp_call_size()} bytes in C, {ctypes.sizeof(Call)} here")
        self.Call, self.max_args = Call, max_args
        self.address = ctypes.cast(lib.hfp_run_calls, ctypes.c_void_p).value


_RUNNER: list = []  # [the _Runner, or None where the library is not built]


def runner() -> _Runner | None:
    if not _RUNNER:
        lib = LIBRARY.load()
        _RUNNER.append(None if lib is None else _Runner(lib))
    return _RUNNER[0]


def enabled() -> bool:
    return os.environ.get("HF_PAGED_CALL_LIST", "1") != "0" and runner() is not None


def signature(fn) -> str | None:
    """The runner's letters for a ctypes function with ``restype`` and ``argtypes`` (None: not a typed C function)."""
    types = getattr(fn, "argtypes", None) if isinstance(fn, ctypes._CFuncPtr) else None
    if types is None or fn.restype not in _LETTERS or any(t not in _LETTERS for t in types):
        return None
    return _LETTERS[fn.restype] + "".join(_LETTERS[t] for t in types)


def _fill(call, sig: str, args: tuple) -> bool:
    # the arguments into ``call`` as the runner reads them; False where one cannot be passed so
    cells = 0
    for j, (letter, a) in enumerate(zip(sig[1:], args)):
        if isinstance(a, ctypes._SimpleCData):  # a cell: its address, read at each run
            if letter == "f" or ctypes.sizeof(a) != _CELL_SIZES[letter]:
                return False
            call.a[j].i = ctypes.addressof(a)
            cells |= 1 << j
        elif letter == "f":
            if not isinstance(a, (int, float)):
                return False
            call.a[j].f = float(a)
        elif letter == "p" and isinstance(a, _BY_ADDRESS):  # the address ctypes would pass
            try:
                call.a[j].i = ctypes.cast(a, ctypes.c_void_p).value or 0
            except (TypeError, ctypes.ArgumentError):
                return False
        elif letter == "p" and a is None:
            call.a[j].i = 0
        elif isinstance(a, int) and not isinstance(a, bool):
            try:  # as ctypes converts it (an int argument keeps its low 32 bits)
                call.a[j].i = ctypes.c_int(a).value if letter == "i" else ctypes.c_int64(a).value
            except TypeError:
                return False
        else:
            return False
    call.cells = cells
    return True


def join(calls: list, apart: frozenset = frozenset(), convert=lambda fn, args: (fn, args)) -> tuple[list, list[int]]:
    """``calls`` (``(fn, args)`` pairs, each C function with its ``argtypes`` and unconverted arguments) with every
    run of consecutive calls the runner takes made one call, and where each of ``calls`` went in the result (a
    joined call's index for each member). Indices in ``apart`` stay calls of their own (the program skips its LM
    head's on a step with no sampled row); the calls left as they were pass through ``convert(fn, args)``. The
    result's entries are ``(fn, args)`` to call as ``fn(*args)``; a
    joined one's ``fn`` names its members (:func:`failed_call`) when it returns a kernel's nonzero code. Every
    tensor and ctypes object the arguments point into must stay alive (the program keeps ``calls``)."""
    run = runner() if enabled() else None
    out: list = []
    where: list[int] = []
    pending: list[tuple] = []  # (fn, args, sig) of the run being gathered

    def flush() -> None:
        if not pending:
            return
        if len(pending) == 1:  # one call gains nothing from the runner
            fn, args, _ = pending[0]
            out.append(convert(fn, args))
        else:
            array = (run.Call * len(pending))()
            for call, (fn, args, sig) in zip(array, pending):
                call.fn, call.sig = ctypes.cast(fn, ctypes.c_void_p).value, run.signatures[sig]
                if not _fill(call, sig, args):  # checked when the call joined the run
                    raise RuntimeError(f"{getattr(fn, '__name__', fn)}: arguments the runner cannot pass")
            twin = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)(run.address)
            at = ctypes.c_int(-1)
            twin.names, twin.at, twin.array = [getattr(fn, "__name__", str(fn)) for fn, _, _ in pending], at, array
            out.append((twin, (ctypes.c_void_p(ctypes.addressof(array)), ctypes.c_int(len(pending)), ctypes.byref(at))))
        pending.clear()

    for i, (fn, args) in enumerate(calls):
        sig = None if run is None or i in apart else signature(fn)
        if sig is not None and (sig not in run.signatures or len(args) != len(sig) - 1
                                or not _fill(run.Call(), sig, args)):
            sig = None
        if sig is None:
            flush()
            where.append(len(out))
            out.append(convert(fn, args))
            continue
        where.append(len(out))
        pending.append((fn, args, sig))
    flush()
    return out, where


def failed_call(fn) -> str:
    """The name of the kernel whose nonzero code ``fn`` (an entry of :func:`join`'s result) returned."""
    names = getattr(fn, "names", None)
    if names is not None and 0 <= fn.at.value < len(names):
        return names[fn.at.value]
    return getattr(fn, "__name__", str(fn))

