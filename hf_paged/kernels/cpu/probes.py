"""Probe, don't assume: every CPU fast path is tried once per process and dtype before the engine uses it.

A fast path (oneDNN or MKL weight packing, the native C attention kernel, a compiled forward) can exist in
this torch build and still fail on this CPU: oneDNN's bf16 packing raises on CPUs without AVX-512 BW/VL/DQ
or AVX-NE-CONVERT, a C compiler can be missing, fail or hang, a kernel built with ``-march=native`` can
compute garbage on an unusual CPU. Each path registers a probe: a tiny real call whose result is checked
against plain torch. A probe that raises, disagrees or times out marks the path unusable for that dtype,
logged once at INFO (``hf-paged -v`` shows it), and callers fall back to the next path.

Probes are cached per ``(path, dtype)`` for the process; :func:`reset` clears the cache (for tests).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeResult:
    """Whether fast path ``path`` works for ``dtype`` here; ``reason`` says why not (one line)."""

    path: str
    dtype: torch.dtype
    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class ProbeMismatch(RuntimeError):
    """A probe ran but its result disagrees with plain torch."""


# path -> function(dtype) that runs a tiny real call and raises on failure or disagreement
_PROBES: dict[str, Callable[[torch.dtype], None]] = {}
_results: dict[tuple[str, torch.dtype], ProbeResult] = {}
_lock = threading.RLock()


def register(path: str, fn: Callable[[torch.dtype], None]) -> None:
    _PROBES[path] = fn


def probe(path: str, dtype: torch.dtype) -> ProbeResult:
    """Run (once) the probe of ``path`` for ``dtype``; never raises for a failing path."""
    key = (path, dtype)
    with _lock:
        result = _results.get(key)
        if result is not None:
            return result
        fn = _PROBES.get(path)
        if fn is None:
            raise ValueError(f"unknown fast path {path!r}; known: {sorted(_PROBES)}")
        try:
            fn(dtype)
            result = ProbeResult(path, dtype, True)
        except Exception as e:  # noqa: BLE001 - any failure of a fast path means: do not use it
            result = ProbeResult(path, dtype, False, _one_line(e))
            logger.info("fast path %s skipped for %s: %s", path, _dtype_name(dtype), result.reason)
        _results[key] = result
        return result


def results() -> list[ProbeResult]:
    """Every probe run so far in this process."""
    with _lock:
        return list(_results.values())


def reset(path: str | None = None) -> None:
    """Forget cached results (of one path, or all), so the next :func:`probe` runs again."""
    with _lock:
        for key in [k for k in _results if path is None or k[0] == path]:
            del _results[key]


def check_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Raise :class:`ProbeMismatch` unless ``got`` matches ``want`` within the dtype's rounding."""
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(want.dtype, 1e-4)
    if got.shape != want.shape:
        raise ProbeMismatch(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    g, w = got.float(), want.float()
    if not torch.isfinite(g).all():
        raise ProbeMismatch(f"{what}: non-finite result")
    err = ((g - w).abs() / (w.abs() + 1.0)).max().item()
    if err > tol:
        raise ProbeMismatch(f"{what}: result differs from plain torch (max relative error {err:.2e} > {tol:.0e})")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first}" if not isinstance(e, ProbeMismatch) else first


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
