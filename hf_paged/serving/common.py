"""What the engine loop, the server and the metrics share: the loop's errors and its per-step record."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hf_paged.outputs import RequestOutput

if TYPE_CHECKING:
    from hf_paged.serving.stream import RequestStream


class QueueFullError(RuntimeError):
    """The engine's waiting queue holds ``max_waiting_requests`` requests already; retry later."""


class EngineClosedError(RuntimeError):
    """The engine loop was shut down; no request can be added."""


@dataclass
class StepInfo:
    """What one step of the loop did, for observers such as the Prometheus metrics.

    Attributes:
        start, end: ``time.time()`` around the step.
        outputs: ``(stream, cumulative output)`` for every request of this loop that changed.
        queue_times: Seconds each request waited before it was first scheduled (requests scheduled now).
        token_intervals: Seconds since the previous token, one entry per request that got new tokens now
            and had some before.
        finished: Streams that finished in this step.
    """

    start: float
    end: float
    outputs: list[tuple[RequestStream, RequestOutput]] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    token_intervals: list[float] = field(default_factory=list)
    finished: list[RequestStream] = field(default_factory=list)


class ThroughputWindow:
    """Generated-token counts by step time (the last 512 steps), for a tokens-per-second reading."""

    def __init__(self) -> None:
        self._history: deque[tuple[float, int]] = deque(maxlen=512)  # (time, generated tokens so far)

    def record(self, when: float, generated: int) -> None:
        self._history.append((when, generated))

    def rate(self, window: float = 2.0) -> float:
        """Generated tokens per second over the last ``window`` seconds of steps (0 when idle)."""
        now = time.time()
        recent = [(t, n) for t, n in list(self._history) if t >= now - window]
        if len(recent) < 2:
            return 0.0
        (t0, n0), (t1, n1) = recent[0], recent[-1]
        return (n1 - n0) / max(now - t0, t1 - t0, 1e-6)

