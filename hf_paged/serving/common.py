"""What the engine loop, the server and the metrics share: the loop's errors, its per-step record, and the
server's worker pool for blocking request work."""

from __future__ import annotations

import asyncio
import concurrent.futures
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


class EngineFailedError(EngineClosedError):
    """The engine can serve no more requests: its executor failed for good (a tensor-parallel worker died) or
    its loop stopped unexpectedly. The message is one short line saying why."""


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



class WorkerPool:
    """Run blocking request work (JSON parsing, chat templates, tokenization) off the asyncio event loop, so
    that one client's huge message never stalls the other clients' streams and cheap requests.

    ``workers`` threads run the calls; at most ``workers`` are handed to them at once (the rest wait on the
    event loop, where a disconnect cancels them before they start), and at most ``max_pending`` calls are
    admitted (running or waiting): one more raises :class:`QueueFullError` and counts in ``num_rejected``
    (the metrics' ``requests_rejected_total{reason="queue_full"}``).
    """

    def __init__(self, workers: int = 2, max_pending: int = 1024,
                 what: str = "requests are being prepared (parsed and tokenized)") -> None:
        for name, value in (("workers", workers), ("max_pending", max_pending)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.workers = workers
        self.max_pending = max_pending
        self.what = what  # the 503's words for the calls it holds
        self.num_pending = 0  # event-loop thread only
        self.num_rejected = 0  # calls refused because max_pending were admitted (event-loop thread only)
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="hf-paged-worker")
        self._slots: asyncio.Semaphore | None = None  # made in the running event loop

    async def run(self, fn, *args):
        """``fn(*args)`` on a worker thread; its result or its exception."""
        if self.num_pending >= self.max_pending:
            self.num_rejected += 1
            raise QueueFullError(f"{self.num_pending} {self.what} already, the limit of this server; retry later")
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        slots = self._slots
        self.num_pending += 1
        try:
            await slots.acquire()
            try:
                future = self._executor.submit(fn, *args)
            except BaseException:
                slots.release()
                raise
            # the slot is free when the thread is done, not when a cancelled caller stops waiting for it
            future.add_done_callback(lambda _: loop.call_soon_threadsafe(slots.release))
            return await asyncio.wrap_future(future)
        finally:
            self.num_pending -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
