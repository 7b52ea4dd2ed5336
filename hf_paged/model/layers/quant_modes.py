"""``quant_activations="auto"``: the fastest quantized-linear kernel mode on this host, measured once.

The three modes give different numbers (``"float"`` is the exact one), so "auto" is for whoever takes any of them
for speed. It considers each mode whose own C kernel builds and passes its probe here (``"bf16"`` only where the
CPU has AMX-BF16: never on AMD Zen 3/4/5), times each on one of the model's quantized layers (the commonest format
and shape, its own bytes) at 1 row and at up to 16 and 64 rows (no more than the engine's ``max_num_seqs``), and
takes the mode with the smallest geometric mean of its times relative to float's, float unless another is at least
:data:`MARGIN` times faster. Timed once per process for each format, shape and row counts (about a third of a
second of kernel calls for the default model's layers).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter

import torch

from hf_paged.kernels.cpu import packed_linear
from hf_paged.model.layers.quant_linear import ACTIVATIONS, QuantLinear, mode_available

logger = logging.getLogger(__name__)

ROWS = (1, 16, 64)  # one decode row; a moderate and a full batch
MARGIN = 1.1  # another mode must beat float (exact) by this factor
_ROUNDS = 4
_CALLS_PER_BATCH = 16  # calls per round at more than one row (compute-bound there: a few weight copies suffice)
_chosen: dict[tuple, str] = {}
_timings: dict[tuple, dict[str, dict[int, float]]] = {}  # _chosen's key -> mode -> rows -> seconds per call


def working_modes() -> list[str]:
    """The modes whose own kernel runs here, in :data:`ACTIVATIONS` order."""
    return [mode for mode in ACTIVATIONS if mode_available(mode)]


def row_counts(max_rows: int) -> tuple[int, ...]:
    """The batch sizes timed for an engine of at most ``max_rows`` sequences."""
    return tuple(sorted({min(rows, max(1, max_rows)) for rows in ROWS}))


def choose_mode(timings: dict[str, dict[int, float]]) -> str:
    """The mode to run given seconds per call of each mode (``"float"`` among them) at each row count."""

    def relative(mode: str) -> float:  # geometric mean over the row counts of this mode's time / float's
        ratios = [timings[mode][rows] / timings["float"][rows] for rows in timings["float"]]
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios))

    best = min(timings, key=relative)
    return best if relative(best) * MARGIN <= 1.0 else "float"


def representative_layer(model: torch.nn.Module) -> QuantLinear | None:
    """The model's commonest quantized layer (format and shape; the larger one on a tie), or None."""
    layers = [m for m in model.modules() if type(m) is QuantLinear]
    if not layers:
        return None
    counts = Counter((m.fmt, m.out_features, m.in_features) for m in layers)
    fmt, n, k = max(counts, key=lambda key: (counts[key], key[1] * key[2]))
    return next(m for m in layers if (m.fmt, m.out_features, m.in_features) == (fmt, n, k))


def fastest_mode(layer: QuantLinear, max_rows: int = 64) -> str:
    """The kernel mode "auto" picks for layers like ``layer`` in an engine of at most ``max_rows`` sequences."""
    rows = row_counts(max_rows)
    key = (layer.fmt, layer.out_features, layer.in_features, rows)
    if key not in _chosen:
        modes = working_modes()
        if "float" not in modes:  # every call dequantizes in torch unless another mode's kernel works
            _chosen[key] = modes[0] if modes else "float"
        elif len(modes) == 1:
            _chosen[key] = "float"
        else:
            _timings[key] = timings = _time_modes(layer, modes, rows)
            _chosen[key] = choose_mode(timings)
            logger.info("quant_activations='auto': %s (%s)", _chosen[key], _summary(key))
    return _chosen[key]


def _time_modes(layer: QuantLinear, modes: list[str], rows: tuple[int, ...]) -> dict[str, dict[int, float]]:
    # Enough copies of the weight to overflow the caches, called in turn: at one row each call reads its weight
    # from DRAM, as every linear of a decode step does (packed_linear.fastest_kind times the same way).
    copies = packed_linear.cold_copies(layer.nbytes, 4, 128)
    scales = layer.scales
    twins = [QuantLinear(layer.in_features, layer.out_features, layer.fmt, layer.qweight.clone(),
                         None if scales is None else scales.clone()) for _ in range(copies)]
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(n, layer.in_features, generator=g) for n in rows}
    batches = {n: twins if n == 1 else twins[:_CALLS_PER_BATCH] for n in rows}
    seconds: dict[tuple[str, int], list[float]] = {(mode, n): [] for mode in modes for n in rows}
    with torch.no_grad():
        for n in rows:  # warm-up, and the copies out of the caches
            for mode in modes:
                _run_calls(batches[n], [mode], inputs[n], [])
        # Each call timed alone and the fastest kept; the modes take turns call by call (mode j half a cycle of
        # copies behind mode i, so each still meets a cold weight) and every round covers every row count: on a
        # busy host (other processes on the cores whose OpenMP threads a call waits for) many calls take a
        # whole time slice longer, for seconds at a time, and a row count timed in one stretch can miss every
        # clean call.
        for _ in range(_ROUNDS):
            for n in rows:
                _run_calls(batches[n], modes, inputs[n], [seconds[mode, n] for mode in modes])
    timings = {mode: {n: min(seconds[mode, n]) for n in rows} for mode in modes}
    del twins
    packed_linear.release_freed_memory()
    return timings


def _run_calls(calls: list[QuantLinear], modes: list[str], x: torch.Tensor, out: list[list[float]]) -> None:
    """Call each of ``calls`` once per mode on ``x`` (mode j ``j * len(calls) // len(modes)`` copies further
    on); the seconds of each call of mode j go to ``out[j]`` when ``out`` is given."""
    stride = len(calls) // len(modes)
    for i in range(len(calls)):
        for j, mode in enumerate(modes):
            twin = calls[(i + j * stride) % len(calls)]
            twin.activations = mode
            start = time.perf_counter()
            twin(x)
            if out:
                out[j].append(time.perf_counter() - start)


def _summary(key: tuple) -> str:
    fmt, n, k, rows = key
    return f"{fmt} {n}x{k}, us per call at {'/'.join(map(str, rows))} rows: " + "; ".join(
        f"{mode} " + "/".join(f"{t[r] * 1e6:.0f}" for r in rows) for mode, t in _timings[key].items())


def describe(fmt: str = "q4_1", out_features: int = 1024, in_features: int = 1024, max_rows: int = 64) -> str:
    """What "auto" picks here for a random layer of this format and shape, and why (for ``hf-paged env``)."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    layer = QuantLinear.from_weight(weight, None, {"q4_1": "int4", "int8": "int8"}[fmt])
    mode = fastest_mode(layer, max_rows)
    key = (fmt, out_features, in_features, row_counts(max_rows))
    return f"picks {mode} ({_summary(key)})" if key in _timings else f"picks {mode} (no other mode's kernel works here)"


def reset() -> None:
    """Forget the choices and timings (for tests)."""
    _chosen.clear()
    _timings.clear()
