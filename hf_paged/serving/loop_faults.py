"""The engine loop when things go wrong or end: a step that raised, an engine that can serve no more, shutdown,
a request refused (the loop shut down or failed, the waiting queue full: counted in ``num_rejected`` by reason).

A mixin of :class:`~hf_paged.serving.engine_loop.AsyncPagedEngine`: these methods run on its loop thread
(:meth:`LoopFaults.wait_for_failure` on any thread) and use its state; the loop itself stays in
``engine_loop.py``.

A failed step fails its requests and the loop goes on. An engine whose executor failed for good (a
tensor-parallel worker died: found after a step, or by the idle loop's health check) cannot serve again: the
loop records one short line in ``failure`` (logged once), fails every request it holds with it, and refuses new
ones with :class:`~hf_paged.serving.common.EngineFailedError`; the server answers ``/health`` with a 503 and, by
default, exits so that a supervisor restarts it.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from hf_paged.outputs import RequestOutput
from hf_paged.core.sequence import SequenceStatus
from hf_paged.serving.common import EngineClosedError, EngineFailedError, QueueFullError

logger = logging.getLogger(__name__)


class LoopFaults:
    """Failure, shutdown and refusal handling of the engine loop (see the module docstring)."""

    def wait_for_failure(self, timeout: float | None = None) -> str | None:
        """Block until the engine can serve no more (its executor failed for good, e.g. a tensor-parallel worker
        died, or the loop thread stopped unexpectedly) and return :attr:`failure`; None after ``timeout``."""
        self._failed.wait(timeout)
        return self.failure

    def _fail_after(self, error: Exception) -> list[RequestOutput]:
        """``step()`` raised outside the forward: fail the requests that were running (all of them when none
        was), so their callers get ``finish_reason="error"`` with the message, and go on."""
        self._failures += 1
        logger.exception("engine step failed; failing the requests it was running")
        message = f"engine step failed: {type(error).__name__}: {error}"
        engine = self.engine
        states = [s for rid, s in list(engine.outputs.requests.items()) if rid in self._streams]
        running = [s.request_id for s in states
                   if any(q.status not in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED) for q in s.seqs.values())]
        victims = running or [s.request_id for s in states]
        try:
            outputs = engine.fail_requests(victims, message)
        except Exception:  # noqa: BLE001 - the engine is in a bad way: end the streams here
            logger.exception("failing the requests of a failed step failed too")
            outputs = []
            for rid in victims:
                try:
                    engine.abort(rid)
                except Exception:  # noqa: BLE001
                    pass
                if rid in self._streams:
                    self._end(self._streams[rid], "error", message)
        if self._failures > 2:
            time.sleep(min(1.0, 0.01 * 2 ** self._failures))  # a persistent failure must not spin
        return outputs

    def _check_engine(self) -> list[RequestOutput]:
        """Once the engine cannot serve (its executor failed for good): record why, once, and fail every request
        it holds with that one line (the requests of the failed step were failed by it already)."""
        if self.failure is None:
            reason = self.engine.check_health()
            if reason is None:
                return []
            self._set_failure(f"engine failed: {reason}")
        live = [rid for rid in list(self.engine.outputs.requests) if rid in self._streams]
        return self.engine.fail_requests(live, self.failure) if live else []

    def _set_failure(self, message: str) -> None:
        with self._cond:
            if self.failure is not None:
                return
            self.failure = message
        logger.error("%s; every request fails from now on", message)
        self._failed.set()

    def _close_down(self) -> None:
        """On the loop thread: end every stream (abort), free the engine, fail pending calls."""
        with self._cond:
            self._closing = True
            inbox, self._inbox = self._inbox, deque()
            calls, self._calls = self._calls, deque()
        for sub in inbox:  # never admitted
            self._end(sub.stream, "abort", "the engine was shut down")
        engine = self.engine
        outputs: list[RequestOutput] = []
        try:
            for rid in list(self._streams):
                engine.abort(rid)
            if engine._pending:
                outputs = engine.step()
        except Exception:  # noqa: BLE001 - fall back to ending the streams here
            logger.exception("aborting the requests in flight at shutdown failed")
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
                if out.finished:
                    self._forget(stream, out)
        for stream in list(self._streams.values()):
            self._end(stream, "abort", "the engine was shut down")
        for _fn, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineClosedError("the engine loop is shut down"))
        if self._close_engine:
            try:
                engine.close()
            except Exception:  # noqa: BLE001
                logger.exception("closing the engine failed")
        self._stopped.set()

    # -- refusing new requests ----------------------------------------------------------------------
    def _check_open(self, count: int = 0) -> None:
        if self.failure is not None:
            self._reject("engine_failed", count)
            raise EngineFailedError(self.failure)
        if self._closing or self._stopped.is_set():
            self._reject("engine_closed", count)
            raise EngineClosedError("the engine loop is shut down; no request can be added")

    def _check_capacity(self, count: int = 1) -> None:
        waiting = self.num_waiting
        if waiting + count > self.max_waiting_requests:
            self._reject("queue_full", count)
            wanted = "" if count == 1 else f"; {count} requests cannot be queued at once"
            raise QueueFullError(
                f"the waiting queue is full ({waiting} requests waiting, "
                f"max_waiting_requests={self.max_waiting_requests}{wanted}); retry later"
            )

    def _reject(self, reason: str, count: int) -> None:
        with self._cond:
            counts = dict(self.num_rejected)
            counts[reason] += count
            self.num_rejected = counts
