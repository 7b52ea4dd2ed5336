"""Pre-packed ``nn.Linear`` weights for CPU engine steps (MKL's packed sgemm, oneDNN's packed linear, our own GEMM).

A plain ``F.linear`` on CPU re-packs (reorders) the whole weight matrix on every call. At the batch sizes of
a decode step (tens of rows) that is a large part of the matmul. Packing each weight once makes the model's
matmuls faster at every row count:

- ``"mkl"`` (fp32): ``cblas_sgemm_pack`` once, ``cblas_sgemm_compute`` per call; the kernel ``F.linear``
  itself uses, so results are bitwise equal except for tiny row counts (``F.linear`` then takes a
  matrix-vector path). ~1.1-1.5x on an Intel Cooper Lake host.
- ``"onednn"`` (fp32 and bf16): ``mkldnn._reorder_linear_weight`` once, ``mkldnn._linear_pointwise`` per
  call. bf16 results are bitwise equal to ``F.linear`` (which runs the same oneDNN kernel); fp32 differs from
  MKL in the last bits (a different summation order). 1.3-2x ``F.linear`` in fp32 on AMD hosts.
- ``"native"`` (fp32; bf16 on CPUs with AVX-512 BF16): our own GEMM (``csrc/gemm_cpu.c``, built for the host
  like the attention kernel), register-blocked panels that prefetch the weights they read next; results do not
  depend on the batch's other rows (oneDNN's may). Layouts and measurements: docs/cpu.md.
- ``"upcast"`` (bf16, fp16): an fp32 copy of the weight, packed by the fastest fp32 packing; inputs are
  widened and outputs rounded back. For CPUs without bf16 arithmetic (AVX2 only), where torch emulates bf16
  matmuls at ~1/6 of the fp32 speed; costs twice the bf16 weights in memory.

Every packing is probed once per process and dtype (:mod:`hf_paged.kernels.cpu.probes`): oneDNN's bf16 packing,
for one, is in every x86 build of torch but raises on CPUs without AVX-512 BW/VL/DQ or AVX-NE-CONVERT. With
``kind="auto"`` the fastest of plain ``F.linear`` and the packings that work is timed once on one of the
model's weight shapes, with the weight coming from DRAM as in an engine step, and kept, per dtype.

:class:`~hf_paged.model.layers.packed.PackedLinears` swaps the ``forward`` of every plain fp32/bf16/fp16 ``nn.Linear`` of a model for one that
uses the packed weight *only inside an engine forward* (``attention.engine_forward``) without autograd; any
other call (training, a plain forward) runs the original ``forward``. A weight changed in place (optimizer
step, ``load_state_dict``) or replaced is re-packed on its next use. :meth:`PackedLinears.remove` restores
the modules. The packed copies cost about as much memory as the weights. (The model-level side, which
modules run through which pack, is :mod:`hf_paged.model.layers.packed`.)
"""

from __future__ import annotations

import ctypes
import logging
import os
import time

import torch

from hf_paged.kernels.cpu import native_gemm, probes, tuning_store
from hf_paged.kernels.cpu.native_gemm import NativePackedWeight

logger = logging.getLogger(__name__)

_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
_lib: ctypes.CDLL | None = None
_tried = False


def _mkl() -> ctypes.CDLL | None:
    """libtorch_cpu with MKL's packed sgemm symbols, or None (another BLAS, or not exported)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        get_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except (OSError, AttributeError):
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    get_size.restype = ctypes.c_size_t
    get_size.argtypes = [i, i, i, i]
    pack.restype = None
    pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
    compute.restype = None
    compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
    _lib = lib
    return _lib


KINDS = ("mkl", "onednn", "native", "upcast")
KIND_NAMES = ", ".join(map(repr, KINDS[:-1])) + f" or {KINDS[-1]!r}"  # for error messages
# Packings that can serve each weight dtype, in the order tried when timings tie.
CANDIDATES = {
    torch.float32: ("onednn", "native", "mkl"),
    torch.bfloat16: ("onednn", "native", "upcast"),
    torch.float16: ("upcast",),
}


def available(kind: str = "any", dtype: torch.dtype = torch.float32) -> bool:
    """Whether packing ``kind`` ("mkl", "onednn", "upcast" or "any") works here for ``dtype`` weights.

    Decided by a probe (a tiny real pack and matmul checked against ``F.linear``), not by build flags:
    oneDNN's bf16 packing, for one, exists in every x86 build but raises on CPUs without AVX-512 BW/VL/DQ.
    """
    kinds = CANDIDATES.get(dtype, ()) if kind == "any" else (kind,)
    return any(probes.probe(f"linear.{k}", dtype).ok for k in kinds)


def unavailable_reason(kind: str, dtype: torch.dtype) -> str:
    """Why ``kind`` cannot pack ``dtype`` weights here ("" if it can)."""
    return probes.probe(f"linear.{kind}", dtype).reason


def _onednn_built() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def _probe_packing(kind: str, dtype: torch.dtype) -> None:
    if dtype not in CANDIDATES or kind not in CANDIDATES[dtype]:
        raise NotImplementedError(f"{kind} packing does not take {str(dtype).removeprefix('torch.')} weights")
    if kind == "mkl" and _mkl() is None:
        raise RuntimeError("this torch build does not export MKL's packed sgemm (cblas_sgemm_pack)")
    if kind == "onednn" and not _onednn_built():
        raise RuntimeError("this torch build has no oneDNN (mkldnn) linear ops")
    if kind == "native" and native_gemm.NATIVE_GEMM.load() is None:
        raise RuntimeError(f"the native GEMM kernel is not built: {native_gemm.NATIVE_GEMM.why}")
    if kind == "native" and dtype == torch.bfloat16 and not native_gemm.NATIVE_GEMM.load().hfp_gemm_bf16_ok():
        raise RuntimeError("the native bf16 GEMM needs AVX-512 BF16, which this CPU (or build) lacks")
    if kind == "upcast" and not available("any", torch.float32):
        raise RuntimeError("no fp32 packing works here to compute in")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    for rows in (1, 7, 33):
        x = torch.randn(rows, 40, generator=g).to(dtype)
        if kind == "upcast":  # every fp32 packing that works, without fixing the one used later
            packs = [UpcastPackedWeight(w, k) for k in CANDIDATES[torch.float32] if available(k, torch.float32)]
        else:
            packs = [PACKERS[kind](w)]
        for pack in packs:
            got = pack.linear(x, b)
            probes.check_close(got, torch.nn.functional.linear(x, w, b), f"{kind} packed linear ({rows} rows)")


for _kind in KINDS:
    probes.register(f"linear.{_kind}", lambda dtype, _k=_kind: _probe_packing(_k, dtype))


class PackedWeight:
    """One fp32 weight ``[out_features, in_features]`` packed as MKL's B operand of ``x @ W^T``."""

    kind = "mkl"

    def __init__(self, weight: torch.Tensor) -> None:
        lib = _mkl()
        assert lib is not None and weight.dtype == torch.float32 and weight.dim() == 2
        self.source = weight
        self.version = weight._version
        self.ptr = weight.data_ptr()  # ``param.data = t`` keeps the object and its version
        w = weight.detach().contiguous()
        self.n, self.k = w.shape
        nbytes = lib.cblas_sgemm_pack_get_size(_B_MATRIX, 64, self.n, self.k)
        self.buffer = torch.empty(-(-nbytes // 4), dtype=torch.float32)
        lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, 64, self.n, self.k, 1.0, w.data_ptr(), self.k, self.buffer.data_ptr())

    def stale(self, weight: torch.Tensor) -> bool:
        return weight is not self.source or weight._version != self.version or weight.data_ptr() != self.ptr

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [..., k] -> [..., n]
        x2 = x.reshape(-1, self.k).contiguous()
        y = torch.empty(x2.shape[0], self.n, dtype=torch.float32)
        _lib.cblas_sgemm_compute(
            _ROW_MAJOR, _NO_TRANS, _PACKED, x2.shape[0], self.n, self.k, x2.data_ptr(), self.k,
            self.buffer.data_ptr(), self.k, 0.0, y.data_ptr(), self.n,
        )
        return y.view(*x.shape[:-1], self.n)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.matmul(x)
        return y if bias is None else y.add_(bias)


class OneDnnPackedWeight:
    """One fp32 or bf16 weight reordered once into oneDNN's blocked layout for ``x @ W^T (+ b)``."""

    kind = "onednn"

    def __init__(self, weight: torch.Tensor) -> None:
        assert weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
        self.source = weight
        self.version = weight._version
        self.ptr = weight.data_ptr()  # ``param.data = t`` keeps the object and its version
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)

    def stale(self, weight: torch.Tensor) -> bool:
        return weight is not self.source or weight._version != self.version or weight.data_ptr() != self.ptr

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")


class UpcastPackedWeight:
    """A bf16/fp16 weight computed in fp32: an fp32 copy packed by the fastest fp32 packing, output rounded back.

    For CPUs without bf16 arithmetic (no AVX-512 BF16, no AMX), where torch emulates bf16 matmuls several
    times slower than fp32 ones. Accumulation is fp32 either way, so results equal ``F.linear`` up to the
    summation order; the fp32 copy costs twice the bf16 weight's memory.
    """

    kind = "upcast"

    def __init__(self, weight: torch.Tensor, inner_kind: str | None = None) -> None:
        assert weight.dtype in (torch.bfloat16, torch.float16) and weight.dim() == 2
        self.source = weight
        self.version = weight._version
        self.ptr = weight.data_ptr()  # ``param.data = t`` keeps the object and its version
        if inner_kind is None:
            inner_kind = upcast_inner_kind(tuple(weight.shape))
        assert inner_kind != "torch", "upcast packing needs an fp32 packing"
        self.inner = PACKERS[inner_kind](weight.detach().float())

    def stale(self, weight: torch.Tensor) -> bool:
        return weight is not self.source or weight._version != self.version or weight.data_ptr() != self.ptr

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.inner.linear(x.float(), None if bias is None else bias.float())
        return y.to(x.dtype)


def upcast_inner_kind(shape: tuple[int, int]) -> str:
    """The fp32 packing under every upcast pack of this process: timed once, on the first weight's ``shape``."""
    global _upcast_inner
    if _upcast_inner is None:
        _upcast_inner = fastest_kind(torch.float32, *shape, include_torch=False)
    return _upcast_inner


def adopt_upcast_inner(kind: str) -> None:
    """Take ``kind`` (another process's :func:`upcast_inner_kind`: a tensor-parallel rank 0's) as decided here."""
    global _upcast_inner
    _upcast_inner = kind


PACKERS = {"mkl": PackedWeight, "onednn": OneDnnPackedWeight, "native": NativePackedWeight, "upcast": UpcastPackedWeight}
_fastest: dict[tuple, str] = {}


def release_freed_memory() -> None:
    """Hand the timing's freed weight copies back to the OS: they were small enough for the allocator to keep,
    and would otherwise stay resident (and be handed out again as already-resident memory, e.g. to the KV pool)."""
    for name in ("malloc_trim", "MallocExtension_ReleaseFreeMemory"):  # glibc; tcmalloc when preloaded
        fn = getattr(_libc(), name, None)
        if fn is not None:
            fn(*((0,) if name == "malloc_trim" else ()))


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def cold_bytes() -> int:
    """Bytes of weight copies fastest_kind cycles through: twice the last-level cache (sysfs), 96 MiB if unknown."""
    size = 0
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            break
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        size = max(size, int(text.rstrip("KMG") or 0) * scale)
    return min(512 << 20, max(32 << 20, 2 * size)) if size else 96 << 20


def cold_copies(nbytes: int, lo: int, hi: int) -> int:
    """How many copies of a weight of ``nbytes`` a kernel timing cycles through so that each call reads its weight
    from DRAM, as every linear of a decode step does: enough to fill :func:`cold_bytes`, within ``[lo, hi]``."""
    return max(lo, min(hi, -(-cold_bytes() // max(1, nbytes))))


def best_round(calls: list, rounds: int) -> float:
    """Seconds per call of the fastest of ``rounds`` passes over ``calls`` (callables of no arguments), after one
    untimed pass (first-call setup, and the weights out of the caches)."""
    for call in calls:
        call()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for call in calls:
            call()
        best = min(best, time.perf_counter() - start)
    return best / len(calls)
_MARGIN = {"upcast": 1.25}
# "native" is kept unless another packing times this much faster: the native decode program
# (cpu/native_program.py) runs native packs as C calls and gains far more with them (batch 1, default model:
# 23-40% of a step) than with other packings' own linear calls (12-17%)
NATIVE_PREFERENCE = 1.15
_upcast_inner: str | None = None
_timings: dict[tuple, dict[str, float]] = {}  # fastest_kind's key -> kind -> seconds per call


def choose_kind(timings: dict[str, float]) -> str:
    """The kind to use given seconds per call of each ("torch" = plain ``F.linear``)."""
    # A packing costs memory (upcast: twice the weights): keep it only if clearly faster than F.linear.
    best = min(timings, key=lambda k: timings[k] * (1.0 if k == "torch" else _MARGIN.get(k, 1.1)))
    native = timings.get("native", float("inf"))
    if best not in ("torch", "native") and native <= timings[best] * NATIVE_PREFERENCE and (
        native * _MARGIN.get("native", 1.1) <= timings.get("torch", float("inf"))
    ):
        best = "native"  # within the margin (and still clearly faster than F.linear): the program gains most
    return best


def fastest_kind(
    dtype: torch.dtype, out_features: int, in_features: int, include_torch: bool = True, rows: int = 32, reps: int = 8
) -> str:
    """Time plain ``F.linear`` and every working packing of ``dtype`` at one weight shape, with the weight
    coming from DRAM as in an engine step; the fastest kind.

    "torch" when no packing works, or (``include_torch``) none clearly beats ``F.linear``. Timed once per
    process and shape (tens of ms: each kind packs and runs copies of the weight that overflow the caches), and
    kept across runs on this host (:mod:`hf_paged.kernels.cpu.tuning_store`): a warm start reads the timings.
    """
    key = (dtype, out_features, in_features, include_torch)
    if key in _fastest:
        return _fastest[key]
    kinds = [k for k in CANDIDATES.get(dtype, ()) if available(k, dtype)]
    if not kinds:
        return "torch"
    stored_key = f"linear:{str(dtype).removeprefix('torch.')}:{out_features}x{in_features}:{rows}rows:" + (
        "with-torch" if include_torch else "packed-only")
    wanted = {*kinds, *(("torch",) if include_torch else ())}
    timings = tuning_store.get(stored_key)
    if timings is None or set(timings) != wanted:  # not stored, or the working kinds changed since
        timings = _time_kinds(dtype, out_features, in_features, kinds, include_torch, rows, reps)
        tuning_store.put(stored_key, timings)
    best = choose_kind(timings)
    _timings[key] = timings
    logger.info(
        "%s linear %dx%d, %d rows: %s -> %s", str(dtype).removeprefix("torch."), out_features, in_features, rows,
        ", ".join(f"{k} {t * 1e6:.0f} us" for k, t in timings.items()), best,
    )
    _fastest[key] = best
    return best


def _time_kinds(dtype: torch.dtype, out_features: int, in_features: int, kinds: list[str], include_torch: bool,
                rows: int, reps: int) -> dict[str, float]:
    """Seconds per call of ``F.linear`` (``include_torch``) and of each packing in ``kinds`` at one shape."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    # Enough copies of the weight to overflow the caches, called in turn: each call reads its weight from
    # DRAM, as every linear of a decode step does. (Timed with one hot weight, oneDNN won for fp32 on a Zen 5
    # host; with the weights coming from DRAM our GEMM, which prefetches them, was 10% faster.)
    copies = cold_copies(w.numel() * w.element_size(), reps, 256)
    weights = [w] + [w.clone() for _ in range(copies - 1)]
    timings = {}
    # two sweeps over the kinds, the second in the opposite order, each kind's best kept: a busy moment of a
    # shared machine (one kind timed 1.5x slow, and the choice kept in the tuning store) needs to hit both
    order = (("torch",) if include_torch else ()) + tuple(kinds)
    for kind in order + order[::-1]:
        if kind == "torch":
            calls = [lambda w=w: torch.nn.functional.linear(x, w) for w in weights]
        else:
            calls = [lambda pack=PACKERS[kind](w): pack.linear(x, None) for w in weights]
        timings[kind] = min(timings.get(kind, float("inf")), best_round(calls, 2))
        del calls
    del weights
    release_freed_memory()
    return timings


def reset() -> None:
    """Forget timings, probe results and the loaded native GEMM library of the packings (for tests)."""
    global _upcast_inner
    native_gemm.NATIVE_GEMM.reset()
    _fastest.clear()
    _timings.clear()
    _upcast_inner = None
    tuning_store.forget()
    for kind in KINDS:
        probes.reset(f"linear.{kind}")


def describe_choice(dtype: torch.dtype, shape: tuple[int, int] = (1024, 1024)) -> str:
    """Which linear kernel ``prepack_weights=None`` picks for ``dtype`` here, and why (for ``hf-paged env``)."""
    name = str(dtype).removeprefix("torch.")
    kind = fastest_kind(dtype, *shape)
    parts = []
    timed = _timings.get((dtype, *shape, True), {})
    if len(timed) > 1:
        parts.append(
            f"fastest at {shape[0]}x{shape[1]}, 32 rows: " + ", ".join(f"{k} {t * 1e6:.0f} us" for k, t in timed.items())
        )
    failed = [f"{k} unavailable: {unavailable_reason(k, dtype)}" for k in CANDIDATES.get(dtype, ()) if not available(k, dtype)]
    parts += failed
    if not CANDIDATES.get(dtype):
        parts.append(f"no packing takes {name} weights")
    label = f"upcast (fp32 compute, {fastest_kind(torch.float32, *shape, include_torch=False)} packing)" if kind == "upcast" else kind
    if kind == "torch":
        label = "torch (F.linear)"
    if kind == "native" and dtype == torch.bfloat16:  # which instructions our bf16 GEMM runs on here
        label = "native (AMX tiles)" if native_gemm.NATIVE_GEMM.load().hfp_gemm_bf16_amx() else "native (VDPBF16PS)"
    return f"{label}" + (f" ({'; '.join(parts)})" if parts else "")
