"""From sequences to what callers see: one :class:`RequestOutput` per user request, stop strings, queues.

A user request owns ``n`` sequences (its samples). The processor keeps them together, matches stop
strings, and builds outputs without copying token lists (see :class:`~hf_paged.outputs.CompletionOutput`).
It reads sequences and never changes them or the scheduler: a stop string that matched comes back from
:meth:`OutputProcessor.check_stops` as a finish for the engine to apply, as an abort would be.
Every output of a request is also appended to the request's own queue when one is attached, so a caller
(``stream``, ``generate``, a server) reads its outputs whoever ran the step that produced them. A request whose
owner reads only its final output (``final_only``: ``generate``) gets no output built until it finishes (building
one per request per step was ~5% of a 64-request run of the default model).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from hf_paged.engine.detokenizer import StopStringChecker
from hf_paged.outputs import CompletionOutput, RequestOutput, SpecDecodeStats
from hf_paged.core.sequence import Sequence, SequenceStatus


@dataclass
class RequestState:
    """The engine's record of one user request and its sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    arrival_time: float
    tokenizer: object = None
    seqs: dict[int, Sequence] = field(default_factory=dict)  # index -> sequence (samples appear when forked)
    stop_checkers: dict[int, StopStringChecker] = field(default_factory=dict)
    stop_strs: dict[int, str] = field(default_factory=dict)  # index -> the stop string that ended that sample
    errors: dict[int, str] = field(default_factory=dict)  # index -> why its stop-string check failed
    queue: deque | None = None  # outputs for a caller that reads this request's outputs
    scores: dict[int, list] | None = None  # index -> processed logits rows (HF output_scores)
    speculative: object = None  # its own SpeculativeConfig: the proposer is built when it is admitted
    # its owner reads only the final output (``generate``): steps build none for it until it finishes
    final_only: bool = False

    @property
    def first(self) -> Sequence:
        return self.seqs[0]

    @property
    def finished(self) -> bool:
        if len(self.seqs) < self.n and not self.first.forked:
            return self.first.is_finished  # finished before its samples were forked
        return all(s.is_finished for s in self.seqs.values())


class OutputProcessor:
    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.ready = threading.Condition()  # notified whenever a queue receives an output
        self.num_finished = 0
        # finished requests whose outputs (or scores) a reader has yet to take: kept until read
        self.finished_queues: dict[str, RequestState] = {}

    def add(self, state: RequestState, first: Sequence, stop: list[str] | None, with_queue: bool) -> None:
        state.seqs[0] = first
        if with_queue:
            state.queue = deque()
        if stop:
            state.stop_checkers[0] = StopStringChecker(state.tokenizer or self.tokenizer, stop, first.prompt_token_ids)
        self.requests[state.request_id] = state

    def state_of(self, request_id: str) -> RequestState | None:
        return self.requests.get(request_id)

    def check_stops(self, changed: list[Sequence]) -> list[tuple[int, SequenceStatus, str | None]]:
        """Register forked samples and match stop strings on the sequences that changed; returns the finishes
        the engine must apply: ``(seq_id, status, error message)`` for a stop string (or a failing check)."""
        finishes = []
        for seq in changed:
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            if seq.index not in state.seqs:
                state.seqs[seq.index] = seq
                if 0 in state.stop_checkers:
                    first = state.stop_checkers[0]
                    state.stop_checkers[seq.index] = StopStringChecker(
                        state.tokenizer or self.tokenizer, first.stops, seq.prompt_token_ids
                    )
            checker = state.stop_checkers.get(seq.index)
            if checker is None:
                continue
            try:
                stop = checker.update(seq.output_token_ids)
            except Exception as e:  # noqa: BLE001 - a failing check (e.g. the tokenizer) fails this request only
                state.errors[seq.index] = f"stop string check failed: {type(e).__name__}: {e}"
                del state.stop_checkers[seq.index]
                if not seq.is_finished:
                    finishes.append((seq.seq_id, SequenceStatus.FINISHED_ERROR, state.errors[seq.index]))
                continue
            if stop is not None:
                state.stop_strs[seq.index] = stop  # wins over max_tokens reached by the same token
                if not seq.is_finished:
                    finishes.append((seq.seq_id, SequenceStatus.FINISHED_STOPPED, None))
            if stop is not None or seq.is_finished:
                del state.stop_checkers[seq.index]
        return finishes

    def process(self, changed: list[Sequence], scores: dict | None = None) -> list[RequestOutput]:
        """Build (and queue) the outputs of the requests whose sequences changed."""
        touched: dict[str, RequestState] = {}
        for seq in changed:
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            state.seqs.setdefault(seq.index, seq)
            if scores and state.scores is not None and seq.seq_id in scores:
                state.scores.setdefault(seq.index, []).extend(scores[seq.seq_id])
            touched[state.request_id] = state
        return [self.emit(state) for state in touched.values() if not state.final_only or state.finished]

    def emit(self, state: RequestState) -> RequestOutput:
        """Build the request's output, queue it for its reader, and forget the request once finished."""
        out = self.output(state)
        if out.finished and state.request_id in self.requests:
            if state.queue is not None:  # in both maps for a moment, never in neither (readers do not lock)
                self.finished_queues[state.request_id] = state
            del self.requests[state.request_id]
            self.num_finished += 1
        if state.queue is not None:
            with self.ready:
                state.queue.append(out)
                self.ready.notify_all()
        return out

    def output(self, state: RequestState) -> RequestOutput:
        first = state.first
        completions = []
        for index in range(state.n):
            seq = state.seqs.get(index)
            if seq is None:  # not forked (yet): nothing generated; finished if the first ended before forking
                reason = first.status.finish_reason if first.is_finished and not first.forked else None
                completions.append(CompletionOutput(index, [], 0, reason, _tokenizer=state.tokenizer or self.tokenizer))
                continue
            want_logprobs = seq.sampling_params.logprobs is not None
            stop_str = state.stop_strs.get(index)
            completions.append(CompletionOutput(
                index=index,
                _source=seq.output_token_ids,
                _length=len(seq.output_token_ids),
                finish_reason="stop" if stop_str is not None and seq.is_finished else seq.status.finish_reason,
                cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
                _logprobs_source=seq.logprobs,
                error=state.errors.get(index, seq.error),
                stop_str=stop_str,
                _tokenizer=state.tokenizer or self.tokenizer,
            ))
        finish_times = [s.finish_time for s in state.seqs.values() if s.finish_time is not None]
        first_times = [s.first_token_time for s in state.seqs.values() if s.first_token_time is not None]
        finished = state.finished
        return RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            arrival_time=state.arrival_time,
            first_token_time=min(first_times, default=None),
            finish_time=max(finish_times, default=None) if finished else None,
            prompt=state.prompt,
            num_cached_tokens=first.num_cached_tokens,
            spec_decode=SpecDecodeStats.of(state.seqs.values()),
        )
