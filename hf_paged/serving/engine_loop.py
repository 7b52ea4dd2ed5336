"""``AsyncPagedEngine``: one ``PagedGenerator`` stepped by one background thread, shared by many callers.

Callers on any thread or asyncio task submit requests and read their own :class:`RequestStream`; only the
loop thread touches the engine (admission, aborts, steps, snapshots), so callers never wait on the engine
lock while a forward runs, and every request in flight shares one continuous batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_paged.engine.generator import PagedGenerator, Prompt
from hf_paged.outputs import EngineStats, RequestOutput
from hf_paged.core.sequence import SequenceStatus
from hf_paged.sampling_params import SamplingParams
from hf_paged.serving.common import EngineClosedError, EngineFailedError, QueueFullError, StepInfo, ThroughputWindow
from hf_paged.serving.loop_faults import LoopFaults
from hf_paged.serving.stream import RequestStream

logger = logging.getLogger(__name__)

__all__ = ["AsyncPagedEngine", "EngineClosedError", "EngineFailedError", "QueueFullError", "StepInfo"]

HEALTH_CHECK_PERIOD_S = 1.0  # an idle loop looks at the executor's health this often (a worker dying meanwhile)


@dataclass
class _Submission:
    stream: RequestStream
    request: Any  # hf_paged.core.sequence.Sequence
    state: Any  # hf_paged.engine.output_processor.RequestState


class AsyncPagedEngine(LoopFaults):
    """Serve one :class:`~hf_paged.PagedGenerator` to many concurrent callers from a background thread.

    Args:
        engine: The engine to drive. From now on only the loop thread may use it; :meth:`shutdown` closes it
            (unless ``close_engine=False``).
        max_waiting_requests: Most requests waiting to be scheduled (submitted but not yet running); one
            more raises :class:`QueueFullError`.
        close_engine: Close ``engine`` on :meth:`shutdown`.

    Example:
        >>> loop = AsyncPagedEngine(PagedGenerator(model, tokenizer))
        >>> for delta in loop.add_request("Hello", SamplingParams(max_tokens=32, temperature=0)):
        ...     print(delta.text, end="")
        >>> loop.shutdown()
    """

    def __init__(self, engine: PagedGenerator, *, max_waiting_requests: int = 1024, close_engine: bool = True) -> None:
        if not isinstance(engine, PagedGenerator):
            raise TypeError(f"engine must be a PagedGenerator, got {type(engine).__name__}")
        if isinstance(max_waiting_requests, bool) or not isinstance(max_waiting_requests, int):
            raise TypeError(f"max_waiting_requests must be an int, got {max_waiting_requests!r}")
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        engine._check_usable()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_waiting_requests = max_waiting_requests
        self.max_model_len = engine.max_model_len
        self._close_engine = close_engine
        self._cond = threading.Condition()  # guards everything below that callers touch
        self._inbox: deque[_Submission] = deque()
        self._aborts: list[str] = []
        self._calls: deque[tuple[Callable, concurrent.futures.Future]] = deque()
        self._streams: dict[str, RequestStream] = {}  # live requests by id
        self._num_engine_waiting = 0  # admitted requests not yet scheduled, as of the last step
        self._closing = False
        self._stopped = threading.Event()
        self._ids = itertools.count()
        self._observers: list[Callable[[StepInfo], None]] = []
        # loop thread only
        self._unscheduled: dict[str, RequestStream] = {}
        self._ended: list[RequestStream] = []  # finished outside a step, not yet shown to the observers
        self._has_work = False
        self._failures = 0
        # read by anyone (replaced, never mutated)
        self.num_finished_by_reason: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        # requests refused when submitted (never queued, so never finished): a full queue, a shut-down loop, a
        # failed engine
        self.num_rejected: dict[str, int] = {"queue_full": 0, "engine_closed": 0, "engine_failed": 0}
        # None while the engine can serve; else one short line saying why it cannot (set once, for good)
        self.failure: str | None = None
        self._failed = threading.Event()
        self._throughput = ThroughputWindow()
        self.last_batch_size = 0
        self._thread = threading.Thread(target=self._run, name="hf-paged-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model, tokenizer=None, *, max_waiting_requests: int = 1024, **config: object) -> AsyncPagedEngine:
        """Build the ``PagedGenerator`` (``**config`` as for it) and its loop."""
        return cls(PagedGenerator(model, tokenizer, **config), max_waiting_requests=max_waiting_requests)

    # -- callers ------------------------------------------------------------------------------------
    def add_request(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
        priority: int = 0, speculative_config: dict | None = None, lora_request=None,
    ) -> RequestStream:
        """Submit a request from any thread or task; returns its stream at once (the loop admits it).

        Args:
            prompt: Text (the engine needs a tokenizer), a list of token ids, or a 1-D integer tensor.
            sampling_params: How to sample (``SamplingParams()`` by default).
            request_id: Unique among live requests; a fresh one by default.
            priority: With ``scheduling_policy="priority"``, lower values run first.
            speculative_config: Speculate for this request with these settings instead of the engine's
                (``SamplingParams(num_speculative_tokens=0)`` turns speculation off for one request).
            lora_request: A :class:`~hf_paged.LoRARequest` (an engine with ``enable_lora``), or None: the base.

        Raises:
            ValueError, TypeError: Bad input (checked here, in the caller's thread), an id in use.
            QueueFullError: ``max_waiting_requests`` requests are already waiting.
            EngineClosedError: After :meth:`shutdown`.
        """
        return self.add_requests([prompt], sampling_params, None if request_id is None else [request_id], priority,
                                 speculative_config, lora_request)[0]

    def add_requests(
        self, prompts: list[Prompt], sampling_params: SamplingParams | None = None,
        request_ids: list[str] | None = None, priority: int = 0, speculative_config: dict | None = None,
        lora_request=None,
    ) -> list[RequestStream]:
        """Submit several requests at once, all or none: every one is checked first, and either all of them
        are queued or (bad input, a full queue, shutdown) none is, so a refused batch leaves nothing to abort.
        Arguments and errors as :meth:`add_request` (one id per prompt; ``lora_request``: one LoRA adapter for
        all of them, or None); a batch larger than
        ``max_waiting_requests`` can never be queued and raises ``ValueError``."""
        self._check_open(len(prompts))
        if request_ids is None:
            request_ids = [f"req-{next(self._ids)}" for _ in prompts]
        if len(request_ids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(request_ids)} request ids")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("request ids must be unique")
        if len(prompts) > self.max_waiting_requests:
            raise ValueError(f"{len(prompts)} requests at once can never fit the waiting queue "
                             f"(max_waiting_requests={self.max_waiting_requests})")
        self._check_capacity(len(prompts))
        subs = []
        for prompt, request_id in zip(prompts, request_ids):
            # Validation and tokenization run here, off the loop thread; they only read the engine's settings.
            request, state = self.engine._make_request(
                prompt, sampling_params, request_id, priority, speculative=speculative_config,
                lora_request=lora_request,
            )
            params = request.sampling_params
            hold = max((len(s) - 1 for s in params.stop or ()), default=0)
            stream = RequestStream(request_id, state.prompt_token_ids, params.n, request.arrival_time,
                                   self.tokenizer, hold, self.abort, state.prompt)
            subs.append(_Submission(stream, request, state))
        with self._cond:
            self._check_open(len(subs))
            for request_id in request_ids:
                if request_id in self._streams:
                    raise ValueError(f"request id {request_id!r} is already in use")
            self._check_capacity(len(subs))
            for sub in subs:
                self._streams[sub.stream.request_id] = sub.stream
                self._inbox.append(sub)
            self._cond.notify()
        return [sub.stream for sub in subs]

    def abort(self, request_id: str) -> bool:
        """Abort a live request from any thread; its stream ends with ``finish_reason="abort"`` and its
        blocks are freed before the next step. False if the id is unknown or already finished."""
        with self._cond:
            if request_id not in self._streams or self._closing:
                return False
            self._aborts.append(request_id)
            self._cond.notify()
            return True

    def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None, **kw) -> RequestOutput:
        """Submit one request and wait for its whole output (blocking)."""
        return self.add_request(prompt, sampling_params, **kw).result()

    async def agenerate(self, prompt: Prompt, sampling_params: SamplingParams | None = None, **kw) -> RequestOutput:
        """Submit one request and await its whole output (cancelling aborts it)."""
        return await self.add_request(prompt, sampling_params, **kw).aresult()

    def call(self, fn: Callable[[PagedGenerator], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the loop thread between two steps (to read engine state safely)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closing:
                future.set_exception(EngineClosedError("the engine loop is shut down"))
                return future
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    async def acall(self, fn: Callable[[PagedGenerator], Any]) -> Any:
        """Await ``fn(engine)`` run on the loop thread between two steps."""
        return await asyncio.wrap_future(self.call(fn))

    def stats(self, timeout: float | None = 30.0) -> EngineStats:
        """``engine.stats()``, taken on the loop thread between steps."""
        return self.call(lambda engine: engine.stats()).result(timeout)

    async def astats(self) -> EngineStats:
        return await self.acall(lambda engine: engine.stats())

    def add_observer(self, observer: Callable[[StepInfo], None]) -> None:
        """Call ``observer(StepInfo)`` on the loop thread after every step (e.g. metrics); it must be quick."""
        self._observers.append(observer)

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet scheduled (the bounded queue)."""
        return len(self._inbox) + self._num_engine_waiting

    @property
    def is_running(self) -> bool:
        return not self._stopped.is_set() and not self._closing

    def generation_throughput(self, window: float = 2.0) -> float:
        """Generated tokens per second over the last ``window`` seconds of steps (0 when idle)."""
        return self._throughput.rate(window)

    # -- shutdown -----------------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = 60.0) -> None:
        """Stop the loop: every request in flight ends with ``finish_reason="abort"`` (none is dropped
        silently), their blocks are freed, the engine is closed, and later calls raise
        :class:`EngineClosedError`. Waits up to ``timeout`` seconds for the step in progress."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    close = shutdown

    def __enter__(self) -> AsyncPagedEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- the loop thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._aborts or self._calls or self._closing or self._has_work):
                        if not self._cond.wait(HEALTH_CHECK_PERIOD_S) and self.failure is None:
                            break  # idle for a while: look at the engine's health below
                    if self._closing:
                        break
                    inbox, self._inbox = self._inbox, deque()
                    aborts, self._aborts = self._aborts, []
                    calls, self._calls = self._calls, deque()
                    self._num_engine_waiting += len(inbox)
                try:
                    self._admit(inbox)
                    self._abort(aborts)
                    self._run_calls(calls)
                    if self.engine.has_unfinished_requests() or self.engine._pending:
                        self._step()
                    else:
                        with self._cond:  # nothing left to step (e.g. every admission failed): nothing waits
                            self._num_engine_waiting = len(self.engine.scheduler.waiting)
                        self._check_engine()  # no request is live in the engine: there is nothing to fail
                        if self._ended:
                            now = time.time()
                            self._notify(StepInfo(now, now))
                    self._has_work = self.engine.has_unfinished_requests() or bool(self.engine._pending)
                except Exception:  # noqa: BLE001 - the loop must survive anything; requests were failed already
                    logger.exception("engine loop iteration failed")
        except BaseException as e:
            self._set_failure(f"engine failed: the engine loop stopped ({type(e).__name__}: {e})")
            raise
        finally:
            self._close_down()

    def _admit(self, inbox: deque[_Submission]) -> None:
        for sub in inbox:
            if self.failure is not None:  # queued before the engine failed
                self._end(sub.stream, "error", self.failure)
                continue
            try:
                with self.engine._lock:
                    self.engine._admit(sub.request, sub.state, queue_outputs=False)
            except Exception as e:  # noqa: BLE001 - e.g. an id the engine saw in the meantime
                self._end(sub.stream, "error", f"request rejected: {type(e).__name__}: {e}")
                continue
            self._unscheduled[sub.stream.request_id] = sub.stream

    def _abort(self, aborts: list[str]) -> None:
        # An id may come several times (a reader cancelled and its handler aborting too): the first abort
        # queues the engine's final output, which the next step hands to the stream and the observers; a
        # second one must not end the stream here, before them.
        for rid in dict.fromkeys(aborts):
            if rid in self._streams and not self.engine.abort(rid):  # unknown to the engine: end it here
                self._end(self._streams[rid], "abort")

    def _run_calls(self, calls) -> None:
        for fn, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)

    def _step(self) -> None:
        start = time.time()
        try:
            outputs = self.engine.step()
            self._failures = 0
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
            outputs = self._fail_after(e)
        outputs += self._check_engine()
        end = time.time()
        sched = self.engine.scheduler
        with self._cond:  # before any stream sees this step: its reader may submit again at once
            self._num_engine_waiting = len(sched.waiting)
        info = StepInfo(start, end)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            info.outputs.append((stream, out))
            new = sum(len(c.token_ids) for c in out.outputs)
            if new > stream.num_tokens_seen:
                if stream.last_token_time is not None:
                    info.token_intervals.append(end - stream.last_token_time)
                stream.last_token_time = end
                stream.num_tokens_seen = new
            if out.finished:
                info.finished.append(stream)
                self._forget(stream, out)
        for rid, stream in list(self._unscheduled.items()):
            state = self.engine.outputs.state_of(rid)
            first = state.first if state is not None else None
            if first is not None and first.status is SequenceStatus.WAITING:
                continue  # still waiting
            del self._unscheduled[rid]
            ran = first.num_computed_tokens > 0 if first is not None else stream.num_tokens_seen > 0
            if ran:  # first scheduled in this step (an abort while waiting is no sample)
                stream.scheduled_time = start
                info.queue_times.append(max(0.0, start - stream.arrival_time))
        self.last_batch_size = len(sched.running)
        self._throughput.record(end, sched.num_generated_tokens)
        self._notify(info)

    def _notify(self, info: StepInfo) -> None:
        """Hand ``info`` to the observers, with the streams that ended outside a step since the last call."""
        ended, self._ended = self._ended, []
        info.finished.extend(ended)
        for observer in self._observers:
            try:
                observer(info)
            except Exception:  # noqa: BLE001 - an observer never breaks serving
                logger.exception("engine loop observer %r failed", observer)

    def _end(self, stream: RequestStream, reason: str, error: str | None = None) -> None:
        """Finish a stream the engine will not report on."""
        stream.finish(reason, error)
        self._forget(stream, stream.last)
        self._ended.append(stream)

    def _forget(self, stream: RequestStream, out: RequestOutput | None) -> None:
        with self._cond:
            self._streams.pop(stream.request_id, None)
        counts = dict(self.num_finished_by_reason)
        for c in out.outputs if out is not None else ():
            if c.finish_reason in counts:
                counts[c.finish_reason] += 1
        self.num_finished_by_reason = counts
