"""Fused elementwise CPU kernels of a Llama-family decoder layer (``csrc/fused_cpu.c``), called through ctypes.

RMSNorm (optionally after the residual add) and rotary embedding of q and k in place, each one C call and
one pass over the rows where the torch code takes several ops and their Python dispatch; the MLP's SiLU-mul in
bf16 (probed on its own, ``layers.silu_mul``); and the row argmax of greedy sampling (``sampling.argmax``). Built by :mod:`hf_paged.kernels.cpu.native` with ``-ffp-contract=off`` and rounded op by op like the
torch code they replace; each dtype is probed once against that torch code (:mod:`hf_paged.kernels.cpu.probes`)
and :func:`available` is False where the build or the probe fails. Used by :mod:`hf_paged.model.layers.fused_decoder`.
"""

from __future__ import annotations

import ctypes
import functools
import time

import torch

from hf_paged.kernels.cpu import probes
from hf_paged.kernels.cpu.native import NativeLibrary

PROBE = "layers.fused"
PROBE_ARGMAX = "sampling.argmax"
PROBE_SILU = "layers.silu_mul"
PROBE_NORM_EXACT = "layers.rms_norm_exact"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
LIBRARY = NativeLibrary(
    "fused_cpu.c",
    {
        "hfp_rms_norm": (None, [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i32, _i32, _f32, _i32, _i32, _i32]),
        "hfp_rope": (None, [_ptr, _i64, _i32, _ptr, _i64, _i32, _ptr, _ptr, _i64, _i32, _i32, _i32, _i32]),
        "hfp_argmax_rows": (None, [_ptr, _i64, _i32, _i32, _i32, _ptr, _ptr, _i32]),
        "hfp_silu_mul_bf16": (None, [_ptr, _i64, _ptr, _i64, _i32, _i32, _i32]),
        "hfp_silu_mul_f32": (None, [_ptr, _i64, _ptr, _i64, _i32, _i32, _i32]),
    },
    extra_flags=("-ffp-contract=off",),
    what="the fused CPU layer kernels",
)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2 or t.stride(-1) != 1 or t.device.type != "cpu" or t.dtype not in _DTYPES:
        raise ValueError(f"{name}: expected a CPU fp32/bf16/fp16 [rows, n] tensor with contiguous rows, got "
                         f"{tuple(t.shape)} {t.dtype} strides {t.stride()} on {t.device}")
    return t


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``weight * norm(h)`` of ``h = x`` or ``h = x + residual``; returns (normalized, h if residual given else None)."""
    _rows(x, "x")
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=x.dtype)
    total = None
    if residual is not None:
        _rows(residual, "residual")
        total = torch.empty(rows, n, dtype=x.dtype)
    LIBRARY.load().hfp_rms_norm(
        x.data_ptr(), x.stride(0), 0 if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
        0 if total is None else total.data_ptr(), n, weight.data_ptr(), out.data_ptr(), n, rows, n, float(eps),
        _DTYPES[x.dtype], torch_sum_lanes(), torch.get_num_threads(),
    )
    return out, total


@functools.cache
def torch_sum_lanes() -> int:
    """The float vector width of torch's CPU sum in this process (8 or 16), the order in which its sums add, which
    the RMSNorm kernel follows to give torch's bits. Measured, not read off the CPU capability: torch 2.13 built
    for AVX-512 still sums in 8-lane vectors on an AVX-512/AMX Xeon. A row of 2W ones with 2^30 at 0 and -2^30 at
    W sums to 2W - 2 when torch adds the two W-lane vectors lane by lane first (the two big values cancel before any
    one is added); with any other width the ones added before the cancelling are lost (a 4-lane torch would
    read as 16). 8 when neither width fits; either way the exactness probe checks the norm against torch's."""
    for lanes in (8, 16):
        row = torch.ones(2 * lanes, dtype=torch.float32, device="cpu")  # (not the default dtype/device)
        row[0], row[lanes] = 2.0**30, -(2.0**30)
        if row.sum().item() == 2 * lanes - 2:
            return lanes
    return 8


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``q`` ``[tokens, heads * d]`` and ``k`` ``[tokens, kv_heads * d]`` in place ("rotate half" layout)
    by ``cos``/``sin`` ``[tokens, d]``."""
    for t, name in ((q, "q"), (k, "k"), (cos, "cos"), (sin, "sin")):
        _rows(t, name)
    d = cos.shape[1]
    LIBRARY.load().hfp_rope(
        q.data_ptr(), q.stride(0), q.shape[1] // d, k.data_ptr(), k.stride(0), k.shape[1] // d, cos.data_ptr(),
        sin.data_ptr(), cos.stride(0), q.shape[0], d, _DTYPES[q.dtype], torch.get_num_threads(),
    )


def argmax_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.max(x, dim=-1)`` of fp32/bf16 ``x [rows, n]``: (maxima as fp32, first indices of them as int64)."""
    _rows(x, "x")
    if x.dtype == torch.float16:
        raise ValueError("argmax_rows takes fp32 or bf16 rows, got torch.float16")
    rows, n = x.shape
    index = torch.empty(rows, dtype=torch.long)
    value = torch.empty(rows, dtype=torch.float32)
    LIBRARY.load().hfp_argmax_rows(x.data_ptr(), x.stride(0), rows, n, _DTYPES[x.dtype], index.data_ptr(),
                                   value.data_ptr(), torch.get_num_threads())
    return value, index


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate = silu(gate) * up`` in place, with torch's two roundings: one C pass where :func:`silu_mul_kernel`
    gives one (torch's bits; in fp32 only where :func:`silu_f32_serves`), torch's own ops otherwise. Returns
    ``gate``."""
    if gate.dtype == torch.bfloat16:  # the kernel's inputs, checked whichever of the two runs here
        _rows(gate, "gate")
        _rows(up, "up")
        if up.shape != gate.shape or up.dtype != gate.dtype:
            raise ValueError(f"up: expected {tuple(gate.shape)} {gate.dtype} like gate, got {tuple(up.shape)} {up.dtype}")
    kernel = silu_mul_kernel(gate.dtype)
    if kernel is not None and gate.dtype == torch.float32 and not (
        gate.dim() == 2 and up.shape == gate.shape and up.dtype == gate.dtype and gate.stride(-1) == up.stride(-1) == 1
        and gate.device.type == up.device.type == "cpu" and silu_f32_serves(*gate.shape, torch.get_num_threads())
    ):
        kernel = None
    if kernel is None:  # torch's silu as the stock model takes it, on a contiguous gate (see silu_f32_serves)
        if gate.is_contiguous():
            return torch.nn.functional.silu(gate, inplace=True).mul_(up)
        return gate.copy_(torch.nn.functional.silu(gate.contiguous())).mul_(up)
    kernel(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), gate.shape[0], gate.shape[1],
           torch.get_num_threads())
    return gate


def silu_mul_kernel(dtype: torch.dtype):
    """The C function :func:`silu_mul_` calls for ``dtype`` (``hfp_silu_mul_bf16`` / ``hfp_silu_mul_f32(gate,
    gate_stride, up, up_stride, rows, n, threads)``, strides in elements), or None where torch's ops serve: not
    bf16 or fp32, or the kernel does not build or pass its probe here, or is not the faster of the two on this
    CPU (timed once: both give torch's bits; bf16 on AVX-512/AMX hosts: 60 us where torch took 105 at 64 x 1536, on
    a Zen 3 236 against 150). The native decode program calls it directly, so both paths decide alike."""
    if dtype not in _SILU_KERNELS or not silu_mul_available(dtype):
        return None
    kernel = getattr(LIBRARY.load(), _SILU_KERNELS[dtype])
    if _SILU_FASTER.get(dtype) is None:
        _SILU_FASTER[dtype] = _silu_is_faster(kernel, dtype)
    return kernel if _SILU_FASTER[dtype] else None


# torch's fp32 silu is its exp (Sleef's) only in its vectorized loop, which steps two vectors at a time (AVX-512:
# 32 floats) from the start of each thread's range; at least GRAIN elements a thread (at::internal::GRAIN_SIZE)
_TORCH_STEP, _TORCH_GRAIN = 32, 32768
_SILU_KERNELS = {torch.bfloat16: "hfp_silu_mul_bf16", torch.float32: "hfp_silu_mul_f32"}


def silu_f32_serves(rows: int, n: int, threads: int) -> bool:
    """Whether the fp32 kernel gives torch's bits for a ``[rows, n]`` gate: where torch's silu (in place on the
    gate's rows, or on the stock model's contiguous gate) runs every element through its vectorized loop, i.e. rows
    and each of its threads' ranges (``ceil(rows * n / threads used)`` elements, as ``at::parallel_for`` splits
    them) are whole steps. Its scalar remainder takes libm's exp, whose bits differ for ~0.2% of inputs; which
    elements take it depends on the gate's layout, so elsewhere :func:`silu_mul_` runs torch's silu on a contiguous
    gate, the stock model's (in place on the strided rows it differed for some widths and thread splits)."""
    numel = rows * n
    used = max(1, min(threads, -(-numel // _TORCH_GRAIN)))
    return n % _TORCH_STEP == 0 and (used == 1 or (-(-numel // used)) % _TORCH_STEP == 0)


_SILU_FASTER: dict[torch.dtype, bool] = {}
SILU_DTYPES = tuple(_SILU_KERNELS)


def silu_choices() -> dict[str, bool]:
    """The SiLU-mul choices this process has timed: dtype name -> whether the C kernel serves (for tensor-parallel
    ranks to run rank 0's: :mod:`hf_paged.model.layers.kernel_choices`)."""
    return {str(d).removeprefix("torch."): v for d, v in _SILU_FASTER.items()}


def adopt_silu_choices(choices: dict[str, bool]) -> None:
    """Take ``choices`` (:func:`silu_choices` of another process) as this process's own."""
    _SILU_FASTER.update({getattr(torch, name): bool(v) for name, v in choices.items()})


def _silu_is_faster(kernel, dtype: torch.dtype, rows: int = 64, n: int = 1536, calls: int = 20) -> bool:
    """Whether ``kernel`` beats torch's silu-then-mul at one decode step's MLP shape: the best of three rounds of
    ``calls`` calls each, the two taking turns (~20 ms on a 2-core Zen 3). The timings are kept across runs in
    :mod:`~hf_paged.kernels.cpu.tuning_store` (its fingerprint covers the C sources, the ISA level, the threads),
    so a warm start reads the choice instead of timing it."""
    from hf_paged.kernels.cpu import tuning_store

    key = f"silu-mul:{str(dtype).removeprefix('torch.')}:{rows}x{n}"
    timings = tuning_store.get(key)
    if timings is None or set(timings) != {"ours", "torch"}:
        gate = (torch.randn(rows, n, generator=torch.Generator().manual_seed(3)) * 0.1).to(dtype)
        up = torch.ones(rows, n, dtype=dtype)  # silu of a small gate times one: the values stay bounded
        threads = torch.get_num_threads()
        fns = {"ours": lambda: kernel(gate.data_ptr(), n, up.data_ptr(), n, rows, n, threads),
               "torch": lambda: torch.nn.functional.silu(gate, inplace=True).mul_(up)}
        timings = {name: float("inf") for name in fns}
        for _ in range(3):
            for name, fn in fns.items():
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                timings[name] = min(timings[name], (time.perf_counter() - start) / calls)
        tuning_store.put(key, timings)
    return timings["ours"] < timings["torch"]


def silu_mul_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the SiLU-mul kernel of ``dtype`` builds here and agrees with torch's (probed once)."""
    return probes.probe(PROBE_SILU, dtype).ok


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernels build here and compute ``dtype`` like the torch code they replace (probed once)."""
    return probes.probe(PROBE, dtype).ok


def unavailable_reason(dtype: torch.dtype = torch.float32) -> str:
    return probes.probe(PROBE, dtype).reason


# torch sums a row of at least this many elements in chunks, one per thread (its reduction grain): another order
ONE_PASS_SUM = 32768


def rms_norm_exact(dtype: torch.dtype, n: int | None = None) -> bool:
    """Whether :func:`rms_norm` gives the bits of transformers' RMSNorm (torch's ops) for ``dtype`` here, the
    residual add included (probed once), for rows of ``n`` elements when given: its sum of squares follows torch's
    CPU sum for torch's vector width in this process (:func:`torch_sum_lanes`) on rows shorter than
    ``ONE_PASS_SUM``, which a torch with another summation order would break."""
    return (n is None or n < ONE_PASS_SUM) and probes.probe(PROBE_NORM_EXACT, dtype).ok


def argmax_available(dtype: torch.dtype) -> bool:
    """Whether :func:`argmax_rows` builds here and agrees with ``torch.max`` for ``dtype`` (probed once)."""
    return probes.probe(PROBE_ARGMAX, dtype).ok


def reset() -> None:
    """Forget the loaded library and probe results (for tests)."""
    LIBRARY.reset()
    probes.reset(PROBE)
    probes.reset(PROBE_ARGMAX)
    probes.reset(PROBE_SILU)
    probes.reset(PROBE_NORM_EXACT)
    _SILU_FASTER.clear()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _probe(dtype: torch.dtype) -> None:
    """Each kernel on odd shapes (several threads' worth of rows, a strided view) against its torch code."""
    if dtype not in _DTYPES:
        raise NotImplementedError(f"the fused kernels take {sorted(str(d) for d in _DTYPES)}, not {dtype}")
    if LIBRARY.load() is None:
        raise RuntimeError(LIBRARY.why or "the fused kernels could not be built")
    g = torch.Generator().manual_seed(0)
    rows, n, eps = 130, 520, 1e-5
    x = torch.randn(rows, n, generator=g).to(dtype)
    res = torch.randn(rows, n + 8, generator=g).to(dtype)[:, :n]
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)

    def norm_ref(h):
        hf = h.float()
        return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

    out, total = rms_norm(x, w, eps)
    probes.check_close(out, norm_ref(x), "fused RMSNorm")
    out, total = rms_norm(x, w, eps, residual=res)
    probes.check_close(total, x + res, "fused residual add")
    probes.check_close(out, norm_ref(x + res), "fused residual add + RMSNorm")
    d, heads, kv_heads = 16, 3, 1
    qk = torch.randn(rows, (heads + kv_heads) * d, generator=g).to(dtype)
    angles = torch.randn(rows, d // 2, generator=g).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q = (qk[:, : heads * d].view(rows, heads, d) * cos[:, None] + _rotate_half(qk[:, : heads * d].view(rows, heads, d)) * sin[:, None])
    want_k = qk[:, heads * d :] * cos + _rotate_half(qk[:, heads * d :]) * sin
    got = qk.clone()
    rope_(got[:, : heads * d], got[:, heads * d :], cos, sin)
    probes.check_close(got[:, : heads * d], want_q.reshape(rows, heads * d), "fused rotary (q)")
    probes.check_close(got[:, heads * d :], want_k, "fused rotary (k)")


def _probe_norm_exact(dtype: torch.dtype) -> None:
    """Rows shorter than a vector, with a tail past the last vector, and long enough for torch's cascade of
    partial sums (4100: 128 steps of 4 vectors at 8 lanes, 64 at 16), bit for bit against torch's ops; 64-row
    batches of short rows, so that a wrong order shows in some row (about one row in four when the width is
    wrong)."""
    if dtype not in _DTYPES:
        raise NotImplementedError(f"the fused kernels take {sorted(str(d) for d in _DTYPES)}, not {dtype}")
    if LIBRARY.load() is None:
        raise RuntimeError(LIBRARY.why or "the fused kernels could not be built")
    g = torch.Generator().manual_seed(4)
    eps = 1e-6
    for rows, n in ((3, 7), (64, 12), (64, 40), (5, 100), (2, 576), (1, 4100)):
        x, res = ((torch.randn(rows, n, generator=g) * 3).to(dtype) for _ in range(2))
        w = (torch.rand(n, generator=g) + 0.5).to(dtype)
        want_total = x + res
        hf = want_total.float()
        want = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
        out, total = rms_norm(x, w, eps, residual=res)
        if not (torch.equal(total, want_total) and torch.equal(out, want)):
            raise probes.ProbeMismatch(f"fused RMSNorm of {rows} x {n} {dtype}: not torch's bits "
                                       f"(torch's CPU capability {torch.backends.cpu.get_cpu_capability()}, "
                                       f"its sum measured {torch_sum_lanes()} lanes wide)")


def _probe_argmax(dtype: torch.dtype) -> None:
    """Ties (the first index wins), a maximum in the tail, NaN rows, an all -inf row, a strided view."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise NotImplementedError(f"the argmax kernel takes torch.float32 and torch.bfloat16, not {dtype}")
    if LIBRARY.load() is None:
        raise RuntimeError(LIBRARY.why or "the fused kernels could not be built")
    g = torch.Generator().manual_seed(1)
    rows = 130
    x = torch.randn(rows, 1000 + 13, generator=g).to(dtype)
    x[:, 7] = x[:, 700] = x[:, 1010] = 9.0
    x[1, 1012] = 10.0
    x[2, 500] = x[2, 600] = float("nan")
    x[5, 1011] = float("nan")
    x[3] = float("-inf")
    value, index = argmax_rows(x[:, 1:])
    want_value, want_index = x[:, 1:].max(dim=-1)
    if not (torch.equal(index, want_index) and torch.equal(value.isnan(), want_value.isnan())
            and torch.equal(value.nan_to_num(), want_value.float().nan_to_num())):
        raise probes.ProbeMismatch("fused argmax: indices or maxima differ from torch.max")


def _probe_silu(dtype: torch.dtype) -> None:
    """Strided rows of a gate|up buffer (the GEMM's output), a tail past the vector width, the values where exp
    overflows or vanishes, infinities and NaN, against torch's silu-then-mul."""
    if dtype not in _SILU_KERNELS:
        raise NotImplementedError(f"the SiLU-mul kernel takes torch.bfloat16 or torch.float32, not {dtype}")
    if LIBRARY.load() is None:
        raise RuntimeError(LIBRARY.why or "the fused kernels could not be built")
    if dtype == torch.float32:
        return _probe_silu_f32()
    g = torch.Generator().manual_seed(2)
    rows, n = 70, 997
    both = (torch.randn(rows, 2 * n, generator=g) * 4).to(dtype)
    both[0, :8] = torch.tensor([-200.0, -88.5, -87.0, 90.0, float("inf"), float("-inf"), float("nan"), -0.0])
    want = torch.nn.functional.silu(both[:, :n].clone()).mul_(both[:, n:])
    got = both.clone()
    LIBRARY.load().hfp_silu_mul_bf16(got.data_ptr(), got.stride(0), got.data_ptr() + n * 2, got.stride(0), rows, n,
                                     torch.get_num_threads())
    got = got[:, :n]
    if not torch.equal(got[0, :8].nan_to_num(), want[0, :8].nan_to_num()) or not torch.equal(got.isnan(), want.isnan()):
        raise probes.ProbeMismatch(f"fused SiLU-mul of {both[0, :8].tolist()}: {got[0, :8].tolist()}, torch "
                                   f"{want[0, :8].tolist()}")
    if (got == want).logical_or(got.isnan()).float().mean() < 0.999:
        raise probes.ProbeMismatch("fused SiLU-mul: more than 1 in 1000 results differ from torch's")
    probes.check_close(got[1:], want[1:], "fused SiLU-mul")


def _probe_silu_f32() -> None:
    """fp32: bitwise torch's, NaN where torch's is NaN, on shapes torch vectorizes throughout (one thread's range;
    two threads' ranges splitting a row), with the values around exp's limits, denormals, infinities and NaN."""
    g = torch.Generator().manual_seed(2)
    threads = torch.get_num_threads()
    for rows, n in ((3, 96), (71, 1024)):
        if not silu_f32_serves(rows, n, threads):
            continue
        both = torch.randn(rows, 2 * n, generator=g) * 6
        both[0, :12] = torch.tensor([-200.0, -104.5, -103.9, -88.5, 100.5, 99.9, 1e-40, -1e-45, float("inf"),
                                     float("-inf"), float("nan"), -0.0])
        want = torch.nn.functional.silu(both[:, :n].clone()).mul_(both[:, n:])
        got = both.clone()
        LIBRARY.load().hfp_silu_mul_f32(got.data_ptr(), got.stride(0), got.data_ptr() + n * 4, got.stride(0), rows, n,
                                        threads)
        got = got[:, :n]
        if not (torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())):
            bad = (got != want).logical_and(~want.isnan()).nonzero()[:4].tolist()
            raise probes.ProbeMismatch(f"fp32 SiLU-mul {rows} x {n}: results at {bad} differ from torch's")


probes.register(PROBE, _probe)
probes.register(PROBE_SILU, _probe_silu)
probes.register(PROBE_NORM_EXACT, _probe_norm_exact)
probes.register(PROBE_ARGMAX, _probe_argmax)
