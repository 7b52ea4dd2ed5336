"""Prefill pacing: size an arriving prompt's chunks by measured step time, so running streams keep their pace.

A token cap alone (``long_prefill_token_threshold``) cannot bound inter-token latency: what a prefill chunk
costs depends on the host and grows with the chunk's context (its attention reads every earlier token), while
a decode step's cost depends on the batch. The pacer closes that loop with the engine's own measurements:

- a step that only decodes sets the decode time ``t_dec`` (a moving average);
- a step that decodes and prefills ``P`` tokens in ``t`` seconds prices a prefill token at ``(t - t_dec) / P``;
- the next chunk gets the tokens that fit ``(max_itl_ratio - 1) * t_dec`` at that price (with a margin), at
  least ``min_chunk`` so a prompt always progresses, at most twice the previous cap so a cheap step never lets
  the next one jump, and never above the token threshold.

Until both have been measured the cap is ``min_chunk``. Pure Python: the engine passes the seconds in.
"""

from __future__ import annotations

import math


def check_max_itl_ratio(value: object) -> float:
    """``max_itl_ratio`` as a float (0.0: off): a number > 1, or None or 0 for off."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"max_itl_ratio must be a number > 1, or None or 0 for no pacing, got {value!r}")
    if value == 0:
        return 0.0
    if not 1.0 < value < math.inf:
        raise ValueError(f"max_itl_ratio must be a number > 1, or None or 0 for no pacing, got {value}")
    return float(value)


class PrefillPacer:
    """The prefill chunk cap while sequences decode, from measured step times.

    Args:
        max_itl_ratio: Target bound of a step that decodes and prefills, as a multiple of a decode-only step.
        min_chunk: The smallest cap (a prompt always progresses by at least this many tokens a step).
        margin: Fraction of the time budget the estimate may fill (measurements are noisy).
    """

    def __init__(self, max_itl_ratio: float, min_chunk: int = 4, margin: float = 0.75) -> None:
        self.max_itl_ratio = check_max_itl_ratio(max_itl_ratio)
        if not self.max_itl_ratio:
            raise ValueError("PrefillPacer needs max_itl_ratio > 1")
        if isinstance(min_chunk, bool) or not isinstance(min_chunk, int) or min_chunk < 1:
            raise ValueError(f"min_chunk must be a positive int, got {min_chunk!r}")
        self.min_chunk = min_chunk
        self.margin = margin
        self.decode_seconds: float | None = None  # moving average of decode-only steps
        self.token_seconds: float | None = None  # last measured cost of one prefill token beside decodes
        self._cap = min_chunk

    def cap(self) -> int:
        """The most prefill tokens one sequence gets in the next step while others decode."""
        return self._cap

    def observe(self, seconds: float, num_decode_rows: int, num_prefill_tokens: int) -> None:
        """Record one step: ``num_decode_rows`` sequences decoding (a token, or a token and its drafts) and
        ``num_prefill_tokens`` prompt or recompute tokens, run in ``seconds``."""
        if num_decode_rows <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return  # nothing decoded: no stream waited on this step
        if num_prefill_tokens <= 0:
            prev = self.decode_seconds
            self.decode_seconds = seconds if prev is None else 0.7 * prev + 0.3 * seconds
            return
        if self.decode_seconds is None:
            return
        extra = max(seconds - self.decode_seconds, 1e-6)
        self.token_seconds = extra / num_prefill_tokens
        budget = (self.max_itl_ratio - 1.0) * self.decode_seconds * self.margin
        fit = int(budget / self.token_seconds)
        self._cap = max(self.min_chunk, min(fit, 2 * self._cap))
