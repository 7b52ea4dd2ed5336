"""Continuous batching: which tokens of which request run this step (pure Python)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.sequence import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens starting at position ``start``."""

    request: Request
    start: int
    num_new_tokens: int
    block_ids: list[int]
    sample: bool  # the step reaches the end of the known tokens, so a token is sampled

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def seq_len(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """FCFS continuous batching under a token budget and a sequence cap.

    Each step: running requests first, in admission order (their decode token, or the next chunk of a
    prompt still being prefilled), then waiting requests in arrival order, a long prompt split into chunks.
    When the pool runs dry the most recently admitted running request is preempted by recompute: its
    blocks are freed and it goes back to the front of the waiting queue with its generated tokens, to be
    prefilled again and resume exactly where it stopped.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_schedule: list[str] = []
        self.num_preemptions = 0

    # -- intake -------------------------------------------------------------------------------------
    def check_request(self, request: Request) -> None:
        """Raise ValueError if the request can never run; nothing is changed."""
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError("prompt is empty: a request needs at least one prompt token")
        if n > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, more than max_model_len={self.max_model_len}")
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {n} tokens, more than max_num_batched_tokens={self.max_num_batched_tokens} "
                "and chunked prefill is disabled"
            )
        # The most slots the request can ever hold: it stops at max_model_len tokens, and the last
        # sampled token is never fed back.
        longest = min(n + request.sampling_params.max_tokens - 1, self.max_model_len)
        longest = max(longest, n)
        if self.kv.blocks_for_tokens(longest) > self.kv.num_blocks:
            raise ValueError(
                f"request needs up to {longest} tokens of KV, more than the whole pool "
                f"({self.kv.num_blocks} blocks x {self.kv.block_size} tokens)"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")

    def add_request(self, request: Request) -> None:
        self.check_request(request)
        request.status = RequestStatus.WAITING
        request.max_model_len = self.max_model_len
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request as aborted and free its blocks; None if it is unknown or already finished."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a live request with ``status`` (e.g. a stop string the engine matched) and free its blocks."""
        assert status.finished, f"{status} is not a finished status"
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- the step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_schedule)
        self._finished_since_schedule = []
        budget = self.max_num_batched_tokens

        # 1. Running requests, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"{request} has nothing to compute"
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1

        # 2. Waiting requests in arrival order (preempted ones are at the front), unless this step had
        #    to preempt: then the pool is too tight to admit anything.
        while self.waiting and not out.preempted_req_ids and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(request, num_new) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish what stopped.

        Returns the requests that received tokens or finished this step.
        """
        now = time.time()
        changed = []
        for item in out.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens = item.seq_len
            tokens = sampled.get(request.request_id)
            if not tokens:
                continue
            for token in tokens:
                status = request.append_output_token(token, now)
                if status is not None:
                    self.running.remove(request)
                    self._finish(request, status, now)
                    break
            changed.append(request)
        return changed

    # -- helpers ------------------------------------------------------------------------------------
    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request=request,
            start=start,
            num_new_tokens=num_new,
            block_ids=self.kv.get_block_ids(request.request_id),
            sample=start + num_new == request.num_tokens,
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus, now: float | None = None) -> None:
        self.kv.free(request)
        request.status = status
        request.finish_time = time.time() if now is None else now
        del self.requests[request.request_id]
        self._finished_since_schedule.append(request.request_id)

    def check_consistency(self) -> None:
        """Assert the block accounting and the queues agree (for tests)."""
        self.kv.check_consistency()
        live = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert live == set(self.requests), "running + waiting differ from the live requests"
        running = {r.request_id for r in self.running}
        assert set(self.kv.req_to_blocks) <= running, "a request holds blocks while not running"
