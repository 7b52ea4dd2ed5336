"""Whether speculation pays at the batch size running now, decided from the engine's own step times.

Drafting k tokens per sequence pays while a step is bound by reading the weights: the target verifies 1 + k
tokens per sequence for about the price of one. Past some batch size the step is bound by arithmetic instead,
every verified token costs what a decoded one does, and rejected drafts (plus the drafting itself) are pure
loss. Where that happens depends on the host, the model, the dtype and the proposer, so the gate does not guess
it: it measures both ways at each batch size and keeps the faster.

- Decode-only steps (every sequence runs one token, or one token and its drafts) are sorted into batch-size
  buckets (1, 2-3, 4-7, 8-15, ...). A step that verified drafts and drafted again is a *speculative* step, one
  that did neither is a *plain* one (a step's time includes drafting for the next, so the steps between the two
  kinds are not measured); each bucket keeps a moving average of the tokens per second the sequences received
  in each kind (speculative steps count their accepted drafts: what a user sees).
- Until a bucket has :attr:`SpecGate.min_samples` steps of a kind it lets that kind run (speculative first),
  then it allows speculation while its rate is at least the plain rate. Every :attr:`SpecGate.reprobe` steps of
  the bucket the losing kind runs :attr:`SpecGate.min_samples` steps again, so a change in the text (acceptance)
  or the context lengths is noticed.
- A bucket not yet measured both ways takes what a neighbour showed where that settles it: speculation that
  costs at a smaller batch costs at a larger one (verifying k drafts per sequence only gets dearer as the step
  turns compute-bound), and speculation that pays at a larger batch pays at a smaller one. So a batch that
  grows past the point where drafting stops paying never measures a losing speculative step again; one that
  shrinks as requests finish measures each smaller bucket (that is where drafting starts to pay).
- Batch 1 is always allowed: there the per-sequence rule of the speculator (acceptance against the
  proposer's relative cost) decides, and a single stream's rate varies too much with its text to compare.

The decision is made when a step is scheduled (whether its sequences propose drafts for the next step); the
measurement is of what each step actually ran. Pure Python: the engine passes the seconds in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Bucket:
    plain_rate: float = 0.0  # moving averages, tokens per second
    spec_rate: float = 0.0
    plain_steps: int = 0
    spec_steps: int = 0
    steps: int = 0  # decisions asked in this bucket (drives the re-probes)


class SpecGate:
    """Allows or stops speculation per batch-size bucket from measured decode steps (see the module docstring).

    Args:
        min_samples: Steps of each kind a bucket measures before it compares them (and per re-probe).
        reprobe: Every this many decisions in a bucket, the losing kind runs ``min_samples`` steps again.
        weight: Weight of the newest step in the moving averages.
    """

    def __init__(self, min_samples: int = 1, reprobe: int = 128, weight: float = 0.25) -> None:
        for name, value in (("min_samples", min_samples), ("reprobe", reprobe)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SpecGate {name} must be an int >= 1, got {value!r}")
        if reprobe <= min_samples:
            raise ValueError(f"SpecGate reprobe ({reprobe}) must exceed min_samples ({min_samples})")
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"SpecGate weight must be in (0, 1], got {weight!r}")
        self.min_samples = min_samples
        self.reprobe = reprobe
        self.weight = weight
        self.buckets: dict[int, _Bucket] = {}
        self.num_stopped = 0  # decisions that stopped speculation (for stats)

    @staticmethod
    def bucket_of(batch: int) -> int:
        return max(1, batch).bit_length()

    def allows(self, batch: int) -> bool:
        """Whether sequences of a step with ``batch`` decoding sequences should draft for the next step."""
        if batch <= 1:
            return True
        key = self.bucket_of(batch)
        b = self.buckets.setdefault(key, _Bucket())
        b.steps += 1
        verdict = self._verdict(b)
        if verdict is None:  # not measured both ways here: what a neighbour showed, else measure
            if any(self._verdict(o) is False for k, o in self.buckets.items() if k < key):
                return self._stop()  # it costs at a smaller batch: a larger one only makes verifying dearer
            if any(self._verdict(o) for k, o in self.buckets.items() if k > key):
                return True  # it pays at a larger batch: a smaller one only makes it cheaper
            return True if b.spec_steps < self.min_samples else self._stop()
        if b.steps % self.reprobe < self.min_samples:  # re-measure the losing kind
            return self._stop() if verdict else True
        return True if verdict else self._stop()

    def _verdict(self, b: _Bucket) -> bool | None:
        """Whether speculation wins in bucket ``b`` (None: not measured both ways yet)."""
        if b.spec_steps < self.min_samples or b.plain_steps < self.min_samples:
            return None
        return b.spec_rate >= b.plain_rate

    def _stop(self) -> bool:
        self.num_stopped += 1
        return False

    def observe(self, seconds: float, num_rows: int, num_tokens: int, speculative: bool) -> None:
        """Record a decode-only step: ``num_rows`` sequences received ``num_tokens`` tokens in ``seconds``;
        ``speculative``: it verified drafts."""
        if num_rows <= 1 or num_tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        b = self.buckets.setdefault(self.bucket_of(num_rows), _Bucket())
        rate = num_tokens / seconds
        w = self.weight
        if speculative:
            b.spec_rate = rate if b.spec_steps == 0 else (1 - w) * b.spec_rate + w * rate
            b.spec_steps += 1
        else:
            b.plain_rate = rate if b.plain_steps == 0 else (1 - w) * b.plain_rate + w * rate
            b.plain_steps += 1

    def summary(self) -> dict[str, dict[str, float]]:
        """Per bucket (``"4-7"``): the measured rates and step counts."""
        out = {}
        for key in sorted(self.buckets):
            b = self.buckets[key]
            low, high = 1 << (key - 1), (1 << key) - 1
            out[f"{low}-{high}" if high > low else str(low)] = {
                "plain_tok_s": round(b.plain_rate, 1), "spec_tok_s": round(b.spec_rate, 1),
                "plain_steps": b.plain_steps, "spec_steps": b.spec_steps,
            }
        return out
