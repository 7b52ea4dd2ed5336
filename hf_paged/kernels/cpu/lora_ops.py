"""The multi-LoRA delta kernel of the CPU (``csrc/lora_cpu.c``), called through ctypes.

One call adds every token's adapter delta to one linear's output, ``y[t] += scale[s] * B[s] @ (A[s] @ x[t])``
with ``s = token_slot[t]`` (``-1``: a base row, left alone), over a slot's stacked ``A [L, R, in]`` and ``B``
kept transposed, ``Bt [L, R, out]`` (:class:`hf_paged.lora.slots.LoRASlot` stores it so on the CPU; the
expand then runs along contiguous output columns), computing only each slot's own rank. fp32 and bf16 (x, A,
Bt and y of one dtype). Built by :mod:`hf_paged.kernels.cpu.native`; probed once per dtype against torch
(:mod:`hf_paged.kernels.cpu.probes`), and :func:`available` is False where the build or the probe fails (the
slots then keep their torch path).
"""

from __future__ import annotations

import ctypes

import torch

from hf_paged.kernels.cpu import probes
from hf_paged.kernels.cpu.native import NativeLibrary

PROBE = "lora.bgmv"
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
LIBRARY = NativeLibrary(
    "lora_cpu.c",
    # x, ldx, a, bt, token_slot, scales, ranks, y, ldy, T, L, in, out, R, dt, threads
    {"hfp_lora_bgmv": (_i32, [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i32, _i32, _i32, _i32, _i32,
                              _i32, _i32]),
     "hfp_lora_bgmv_call": (_i32, [_ptr, _ptr, _i32])},
    extra_flags=("-ffp-contract=off",),  # PEFT's order: the scale and the add are two roundings
    what="the CPU LoRA delta kernel",
)


def _check(t: torch.Tensor, name: str, dim: int, dtype: torch.dtype | None = None) -> None:
    if t.device.type != "cpu" or t.dim() != dim or (t.numel() and t.stride(-1) != 1):
        raise ValueError(f"{name}: expected a CPU {dim}-d tensor with a contiguous last dimension, got "
                         f"{tuple(t.shape)} strides {t.stride()} on {t.device}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected {dtype}, got {t.dtype}")


def bgmv_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, token_slot: torch.Tensor,
          scales: torch.Tensor, ranks: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """Add each token's adapter delta into ``y`` in place and return it.

    Args:
        y: ``[T, out]`` fp32 or bf16, rows of any stride (a column view of a wider output is fine).
        x: ``[T, in]`` of ``y``'s dtype, rows of any stride.
        a: ``[L, R, in]`` contiguous, the slots' A (zeros past each rank).
        bt: ``[L, R, out]`` contiguous, the slots' B transposed (zeros past each rank).
        token_slot: int32 ``[T]``, each token's slot, ``-1`` for none.
        scales: fp32 ``[L]``; ranks: int32 ``[L]`` (each ``<= R``; 0: the slot adds nothing here).
        num_threads: Threads to split a large call over (default: torch's).

    Raises:
        ValueError: a shape, dtype, layout or rank the kernel does not take (naming it).
    """
    if y.dtype not in DTYPES:
        raise ValueError(f"y: the LoRA kernel takes {sorted(map(str, DTYPES))}, got {y.dtype}")
    _check(y, "y", 2)
    _check(x, "x", 2, y.dtype)
    for t, name in ((a, "a"), (bt, "bt")):
        _check(t, name, 3, y.dtype)
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    _check(token_slot, "token_slot", 1, torch.int32)
    _check(scales, "scales", 1, torch.float32)
    _check(ranks, "ranks", 1, torch.int32)
    T, n_in = x.shape
    L, R, _ = a.shape
    n_out = y.shape[1]
    if (y.shape[0], token_slot.shape[0], tuple(a.shape), tuple(bt.shape), scales.shape[0], ranks.shape[0]) != (
            T, T, (L, R, n_in), (L, R, n_out), L, L):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)}, "
                         f"bt {tuple(bt.shape)}, token_slot {tuple(token_slot.shape)}, scales {tuple(scales.shape)}, "
                         f"ranks {tuple(ranks.shape)} (expected a [L, R, in], bt [L, R, out], [T] and [L])")
    if L and (int(ranks.max()) > R or int(ranks.min()) < 0):
        raise ValueError(f"ranks {ranks.tolist()}: each must be in 0..R={R}")
    if T:
        call(y, x, a, bt, token_slot, scales, ranks, torch.get_num_threads() if num_threads is None else num_threads)
    return y


def call(y, x, a, bt, token_slot, scales, ranks, num_threads: int) -> None:
    """:func:`bgmv_` without its checks (the caller made the arguments so)."""
    L, R, n_in = a.shape
    rc = LIBRARY.load().hfp_lora_bgmv(
        x.data_ptr(), x.stride(0), a.data_ptr(), bt.data_ptr(), token_slot.data_ptr(), scales.data_ptr(),
        ranks.data_ptr(), y.data_ptr(), y.stride(0), x.shape[0], L, n_in, y.shape[1], R, DTYPES[y.dtype], num_threads)
    assert rc == 0, "the LoRA kernel refused its arguments (a rank above R or an unknown dtype)"


class Call(ctypes.Structure):
    """A replayed call's fixed arguments (``LoraCall`` in the C file): the per-step token slots and row count
    are the only arguments of ``hfp_lora_bgmv_call(byref(call), token_slot, T)``."""

    _fields_ = [("x", _ptr), ("ldx", _i64), ("a", _ptr), ("bt", _ptr), ("scales", _ptr), ("ranks", _ptr),
                ("y", _ptr), ("ldy", _i64), ("L", ctypes.c_int32), ("in_features", ctypes.c_int32),
                ("out_features", ctypes.c_int32), ("R", ctypes.c_int32), ("dt", ctypes.c_int32),
                ("num_threads", ctypes.c_int32)]


def replay_call(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scales: torch.Tensor,
                ranks: torch.Tensor, num_threads: int, token_slot: ctypes.c_void_p, rows: ctypes.c_int) -> tuple:
    """``(fn, args)`` that adds the deltas of the rows ``rows`` (a ``ctypes`` cell read at each call) with the
    token slots at ``token_slot`` (a pointer cell), for a caller that keeps every tensor alive at its address."""
    L, R, n_in = a.shape
    fixed = Call(x.data_ptr(), x.stride(0), a.data_ptr(), bt.data_ptr(), scales.data_ptr(), ranks.data_ptr(),
                 y.data_ptr(), y.stride(0), L, n_in, y.shape[1], R, DTYPES[y.dtype], num_threads)
    return LIBRARY.load().hfp_lora_bgmv_call, (ctypes.byref(fixed), token_slot, rows)


_AVAILABLE: dict[torch.dtype, bool] = {}  # the probes' answers, read on every linear's call


def available(dtype: torch.dtype) -> bool:
    """Whether the kernel builds here and agrees with torch for ``dtype`` (probed once)."""
    ok = _AVAILABLE.get(dtype)
    if ok is None:
        ok = _AVAILABLE[dtype] = dtype in DTYPES and probes.probe(PROBE, dtype).ok
    return ok


def unavailable_reason(dtype: torch.dtype) -> str:
    if dtype not in DTYPES:
        return f"the LoRA kernel takes {sorted(map(str, DTYPES))}, not {dtype}"
    return probes.probe(PROBE, dtype).reason


def reset() -> None:
    """Forget the loaded library and the probe results (for tests)."""
    LIBRARY.reset()
    probes.reset(PROBE)
    _AVAILABLE.clear()


def reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, token_slot: torch.Tensor,
              scales: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """What :func:`bgmv_` computes, in float64 torch: ``y`` plus every token's delta (a new float64 tensor).
    For bf16 inputs each product is rounded to bf16 where PEFT's bf16 modules round it (A x, B h, the scaled
    delta, the sum)."""
    rnd = (lambda t: t) if y.dtype == torch.float32 else (lambda t: t.to(y.dtype).double())  # noqa: E731
    out = y.double().clone()
    for t, s in enumerate(token_slot.tolist()):
        r = int(ranks[s]) if s >= 0 else 0
        if r:
            h = rnd(a[s, :r].double() @ x[t].double())
            out[t] = rnd(out[t] + rnd(rnd(h @ bt[s, :r].double()) * float(scales[s])))
    return out


def _probe(dtype: torch.dtype) -> None:
    """Odd sizes, mixed ranks and slots with base rows, a column view of y, on both the one-thread and the
    threaded split."""
    if dtype not in DTYPES:
        raise NotImplementedError(f"the LoRA kernel takes {sorted(map(str, DTYPES))}, not {dtype}")
    if LIBRARY.load() is None:
        raise RuntimeError(LIBRARY.why or "the LoRA kernel could not be built")
    g = torch.Generator().manual_seed(0)
    L, R, n_in, n_out = 3, 12, 37, 45
    ranks = torch.tensor([5, 0, 12], dtype=torch.int32)
    scales = torch.tensor([0.5, 1.0, 2.0])
    a = torch.randn(L, R, n_in, generator=g)
    bt = torch.randn(L, R, n_out, generator=g)
    for s, r in enumerate(ranks.tolist()):
        a[s, r:], bt[s, r:] = 0, 0
    a, bt = a.to(dtype), bt.to(dtype)
    for T in (1, 9):
        x = torch.randn(T, n_in, generator=g).to(dtype)
        wide = torch.randn(T, n_out + 7, generator=g).to(dtype)
        y = wide[:, 3: 3 + n_out]
        token_slot = torch.tensor([(-1, 0, 2, 1)[t % 4] for t in range(T)], dtype=torch.int32)
        want = reference(y, x, a, bt, token_slot, scales, ranks).to(dtype)
        for threads in (1, 2):
            got = y.clone()
            bgmv_(got, x, a, bt, token_slot, scales, ranks, num_threads=threads)
            probes.check_close(got, want, f"LoRA kernel, {T} tokens")


probes.register(PROBE, _probe)
