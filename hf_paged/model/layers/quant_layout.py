"""Which int8-activation kernel a quantized weight family runs, and the interleaved ("rows8") weight copy.

In ``quant_activations="int8"`` mode a :class:`~hf_paged.model.layers.quant_linear.QuantLinear` runs one of two C
kernels: ``hfq8_linear`` on the stored GGUF-layout blocks (``csrc/quant_q8.c``; VNNI/AMX where present), or
``hfq8i_linear`` on a copy of the weight with 8 output rows interleaved (``csrc/quant_q8_rows8.h``; VPMADDUBSW
sums without VNNI, VPDPBUSD with it, AMX above 16 rows). Both compute every output by the same operations in the
same order, so a row's bits are the same whichever runs. :func:`rows8_chosen` decides once per process per weight
family by speed; :func:`rows8_copy` makes the copy.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from hf_paged.kernels.cpu.quant_formats import FORMATS, quantize

logger = logging.getLogger(__name__)

ROWS8_ENV = "HF_PAGED_Q8_LAYOUT"  # "rows8" / "blocks": force the int8-mode kernel (default: timed per weight family)
# the formats whose int8-mode kernel is chosen together, and the format timed for each family. Both kernels give
# every output the same bits (csrc/quant_q8_rows8.h), so the choice is speed only. (The int8 format, per-row scales,
# kept the block kernel while the two differed in the last bits: with rows8 on it one test saw the engine's greedy
# tokens leave stock generate's on the same quantized layers.)
FAMILIES = {"q4_0": "q4_1", "q4_1": "q4_1", "q8_0": "q8_0", "int8": "int8"}
_chosen: dict[str, bool] = {}


def rows8_chosen(fmt: str, lib) -> bool:
    """Whether int8-mode linears of format ``fmt`` run the rows8 kernel on an interleaved copy of the weight
    (``csrc/quant_q8_rows8.h``) rather than ``hfq8_linear`` on the stored blocks.

    Decided once per process for each weight family (4-bit: Q4_0/Q4_1; Q8_0), for every batch size: by
    ``HF_PAGED_Q8_LAYOUT`` if set, else by timing both kernels at one and at 32 rows on a default-model-sized
    weight of the family (kept across runs in :mod:`hf_paged.kernels.cpu.tuning_store`). Both give each output the
    same bits, so the choice changes speed and memory (the copy sits beside ``qweight``), never a result. Without
    VNNI the rows8 kernel was 2.2-3.7x faster per call on Q4_1 on a Zen 3 host; with VNNI and AMX both use the
    same instructions, hence the timing. ``lib``: the int8-mode C library in use (a build of ``quant_q8.c``), or
    None.
    """
    family = FAMILIES[fmt]
    if family is None:
        return False
    if family not in _chosen:
        forced = os.environ.get(ROWS8_ENV, "").strip().lower()
        if forced not in ("", "rows8", "blocks"):
            raise ValueError(f"{ROWS8_ENV} must be 'rows8' or 'blocks' (or unset: timed), got {forced!r}")
        if lib is None or not lib.hfq8i_available():
            _chosen[family] = False
        elif forced:
            _chosen[family] = forced == "rows8"
        else:
            _chosen[family] = _time_rows8(lib, family)
    return _chosen[family]


def layout_choices() -> dict[str, bool]:
    """Weight family -> whether its int8-mode linears run rows8, as decided in this process so far."""
    return dict(_chosen)


def adopt_layout_choices(choices: dict[str, bool]) -> None:
    """Take ``choices`` (:func:`layout_choices` of another process, a tensor-parallel rank 0) as decided here."""
    _chosen.update(choices)


def forget() -> None:
    """Forget the choices (tests; a changed ``HF_PAGED_Q8_LAYOUT``)."""
    _chosen.clear()


def _time_rows8(lib, fmt: str, out_features: int = 960, in_features: int = 576) -> bool:
    from hf_paged.kernels.cpu import tuning_store
    from hf_paged.kernels.cpu.packed_linear import cold_copies

    # the build's file name carries a hash of the kernel sources: a changed kernel is timed again
    key = f"q8-layout:{fmt}:{out_features}x{in_features}:{Path(getattr(lib, '_name', '') or '').stem}"
    timings = tuning_store.get(key)
    if timings is None or set(timings) != {"blocks", "rows8"}:
        g = torch.Generator().manual_seed(0)
        _, qweight, scales = quantize(torch.randn(out_features, in_features, generator=g), fmt)
        code, threads = FORMATS[fmt], torch.get_num_threads()
        scales_ptr = None if scales is None else scales.data_ptr()  # the int8 format's per-row scales
        blocks = [qweight.clone() for _ in range(cold_copies(qweight.numel(), 4, 64))]
        weights = {"blocks": blocks, "rows8": [_repack(lib, w, code, out_features, in_features) for w in blocks]}
        fns = {"blocks": lib.hfq8_linear, "rows8": lib.hfq8i_linear}
        timings = {"blocks": 0.0, "rows8": 0.0}
        for rows in (1, 32):  # seconds for one weight at both row counts
            x = torch.randn(rows, in_features, generator=g)
            y = torch.empty(rows, out_features)
            calls = {name: [lambda w=w, fn=fns[name]: _checked(fn(x.data_ptr(), in_features, w.data_ptr(), code,
                                                                  scales_ptr, None, y.data_ptr(), out_features, rows,
                                                                  out_features, in_features, threads))
                            for w in weights[name]] for name in fns}
            for name, seconds in _fastest_calls(calls, 3).items():
                timings[name] += seconds
        tuning_store.put(key, timings)
    chosen = timings["rows8"] < timings["blocks"]
    logger.info("int8 kernel for %s weights: blocks %.0f us, rows8 %.0f us -> %s", fmt, timings["blocks"] * 1e6,
                timings["rows8"] * 1e6, "rows8" if chosen else "blocks")
    return chosen


def _checked(rc: int) -> None:
    if rc != 0:  # a call that returns at once would time as the fastest
        raise RuntimeError(f"int8 kernel timing: the kernel returned {rc}")


def _fastest_calls(calls: dict[str, list], rounds: int) -> dict[str, float]:
    """Seconds of the fastest single call of each kind (``calls``: kind -> one call per cold weight copy).

    The kinds take turns call by call and each call is timed alone: on a busy host (another process on a core
    whose OpenMP thread a call waits for) many calls lose a whole time slice, and a kind timed over a stretch of
    calls can lose all of them while the other does not."""
    for kind_calls in calls.values():  # first-call setup, and the weights out of the caches
        for call in kind_calls:
            call()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for i in range(max(len(kind_calls) for kind_calls in calls.values())):
            for kind, kind_calls in calls.items():
                start = time.perf_counter()
                kind_calls[i % len(kind_calls)]()
                best[kind] = min(best[kind], time.perf_counter() - start)
    return best


def _repack(lib, w: torch.Tensor, code: int, out_features: int, in_features: int) -> torch.Tensor:
    with torch.inference_mode(False):  # made inside a step too; kept across steps
        copy = torch.empty(lib.hfq8i_bytes(code, out_features, in_features), dtype=torch.uint8)
    rc = lib.hfq8i_repack(w.data_ptr(), code, out_features, in_features, copy.data_ptr(), torch.get_num_threads())
    assert rc == 0, f"hfq8i_repack failed ({rc})"
    return copy


def rows8_copy(layer, lib) -> torch.Tensor:
    """The interleaved copy of ``layer.qweight`` (a QuantLinear's) for the rows8 kernel of ``lib``, made on first
    use and again if ``qweight`` is replaced or changed in place, kept on the layer. It costs about as many bytes
    as ``qweight`` besides it (the same fp16 scales, rearranged; a group of 8 rows pads its scales to 32 bytes)."""
    w = layer.qweight
    key = (id(w), w.data_ptr(), None if w.is_inference() else w._version)
    cached = layer._rows8_cache
    if cached is None or cached[0] != key:
        copy = _repack(lib, w, FORMATS[layer.fmt], layer.out_features, layer.in_features)
        cached = layer._rows8_cache = (key, copy)
    return cached[1]
