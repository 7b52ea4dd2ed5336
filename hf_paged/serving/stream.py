"""``RequestStream``: one request's outputs, handed from the engine loop's thread to any thread or asyncio task."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from hf_paged.engine.detokenizer import DeltaTracker, delta_output
from hf_paged.outputs import CompletionOutput, RequestOutput


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class RequestStream:
    """The outputs of one request submitted to an :class:`~hf_paged.serving.AsyncPagedEngine`.

    Iterate it (``for delta in stream`` from a thread, ``async for delta in stream`` from asyncio) to get
    :class:`~hf_paged.outputs.RequestOutput` items whose token ids and text are the delta since the previous
    item, as ``PagedGenerator.stream`` yields them; the last item carries the finish reason (``"stop"``,
    ``"length"``, ``"abort"`` or ``"error"`` with ``CompletionOutput.error``). When the reader is slower than
    the engine, the steps it missed arrive merged in one item. Leaving the iteration early (``break``, an
    exception, a cancelled task) aborts the request. A stream is iterated once; :meth:`result` and
    :meth:`aresult` wait for the end instead and return the whole output.

    Attributes:
        request_id: The request's id in the engine.
        prompt_token_ids: The prompt as token ids.
        arrival_time: ``time.time()`` when the request was submitted.
        last: The newest cumulative output received from the engine (None before the first).
    """

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], n: int, arrival_time: float, tokenizer,
        hold: int, abort: Callable[[str], bool], prompt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.prompt = prompt
        self.n = n
        self.arrival_time = arrival_time
        self.last: RequestOutput | None = None
        self._tokenizer = tokenizer
        self._hold = hold  # text that may still be the start of a stop string is held back this many chars
        self._abort = abort
        self._item: RequestOutput | None = None  # the newest output not yet read (it contains the older ones)
        self._cond = threading.Condition()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self._done = False  # the final output has arrived
        self._claimed = False
        self._read_final = False
        self._abort_sent = False
        # Bookkeeping of the loop thread (metrics): when the request was first scheduled, its last token.
        self.scheduled_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens_seen = 0

    # -- the engine loop's side -----------------------------------------------------------------------
    def put(self, item: RequestOutput) -> None:
        """Hand over a cumulative output (called by the engine loop; ignored after the final one)."""
        with self._cond:
            if self._done:
                return
            self._item = item
            self.last = item
            self._done = item.finished
            self._cond.notify_all()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, future = waiter
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # the reader's event loop is closed: nobody is waiting any more
                pass

    def finish(self, reason: str, error: str | None = None) -> None:
        """End the stream with ``reason`` on every unfinished completion, keeping the tokens received so far."""
        self.put(final_output(self.last, self.request_id, self.prompt_token_ids, self.n, self.arrival_time,
                              reason, error, self.prompt, self._tokenizer))

    # -- the reader's side ----------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """The final output has arrived (it may not have been read yet)."""
        return self._done

    def abort(self) -> bool:
        """Abort the request in the engine (its final item then has ``finish_reason="abort"``). Only the first
        call asks the engine (later ones return False), so the request is aborted, and counted, once."""
        if self._abort_sent or self._done:
            return False
        self._abort_sent = True
        return self._abort(self.request_id)

    def _claim(self) -> list[DeltaTracker]:
        with self._cond:
            if self._claimed:
                raise RuntimeError(f"the stream of request {self.request_id!r} is already being read")
            self._claimed = True
        return [DeltaTracker(self._tokenizer, self._hold) for _ in range(self.n)]

    def _take(self) -> RequestOutput | None:
        """The newest unread output, or None; call with ``_cond`` held."""
        item, self._item = self._item, None
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        trackers = self._claim()
        try:
            while True:
                with self._cond:
                    while self._item is None:
                        self._cond.wait()
                    item = self._take()
                if item.finished:
                    self._read_final = True
                yield delta_output(item, trackers)
                if item.finished:
                    return
        finally:
            if not self._read_final:
                self.abort()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        trackers = self._claim()
        loop = asyncio.get_running_loop()
        try:
            while True:
                item = await self._next_async(loop)
                if item.finished:
                    self._read_final = True
                yield delta_output(item, trackers)
                if item.finished:
                    return
        finally:
            if not self._read_final:
                self.abort()

    async def _next_async(self, loop: asyncio.AbstractEventLoop) -> RequestOutput:
        while True:
            with self._cond:
                item = self._take()
                if item is None:
                    future = loop.create_future()
                    self._waiter = (loop, future)
            if item is not None:
                return item
            try:
                await future
            finally:
                with self._cond:
                    if self._waiter is not None and self._waiter[1] is future:
                        self._waiter = None

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the request to finish and return its whole (cumulative) output.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the request keeps running).
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout} s")
            return self.last

    async def aresult(self) -> RequestOutput:
        """Await the request's end and return its whole (cumulative) output. Cancelling the awaiting task
        aborts the request."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                with self._cond:
                    if self._done:
                        return self.last
                    future = loop.create_future()
                    self._waiter = (loop, future)
                try:
                    await future
                finally:
                    with self._cond:
                        if self._waiter is not None and self._waiter[1] is future:
                            self._waiter = None
        finally:
            if not self._done:
                self.abort()


def final_output(
    last: RequestOutput | None, request_id: str, prompt_token_ids: list[int], n: int, arrival_time: float,
    reason: str, error: str | None = None, prompt: str | None = None, tokenizer=None,
) -> RequestOutput:
    """A finished output for a request the engine cannot report on: its tokens so far, ``reason`` on every
    completion that had not finished."""
    completions = []
    for index in range(n):
        c = last.outputs[index] if last is not None else None
        if c is not None and c.finished:
            completions.append(c)
            continue
        completions.append(CompletionOutput(
            index,
            c._source if c is not None else [],
            c._length if c is not None else 0,
            reason,
            c.cumulative_logprob if c is not None else None,
            c._logprobs_source if c is not None else None,
            error,
            _tokenizer=c._tokenizer if c is not None else tokenizer,
        ))
    return RequestOutput(
        request_id, prompt_token_ids, completions, True, arrival_time,
        last.first_token_time if last is not None else None, time.time(), prompt,
        last.num_cached_tokens if last is not None else 0,
    )
