"""A request and its life cycle (pure Python: no torch, no transformers)."""

from __future__ import annotations

import enum
import time

from hf_paged.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One generation request.

    The scheduler's single rule: bring ``num_computed_tokens`` (tokens whose KV is in the cache) up to
    ``num_tokens`` (prompt + generated). A prefill chunk, a decode step and a resumed preempted request
    are all cases of it.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int | None = None,
        arrival_time: float | None = None,
        prompt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        stop = set(sampling_params.stop_token_ids or ())
        if not sampling_params.ignore_eos:
            stop |= set(eos_token_ids)
        self.stop_token_ids = frozenset(stop)
        self.max_model_len = max_model_len
        # When a list, the sampler appends each step's processed logits row (for HF's output_scores).
        self.scores: list | None = None
        self.stop_str: str | None = None  # the stop string that ended the request, if any

    # -- sizes --------------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_id(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def stop_tokens_allowed(self) -> bool:
        """False while ``min_tokens`` forbids stop tokens for the next sampled token."""
        return len(self.output_token_ids) >= self.sampling_params.min_tokens

    # -- state changes ------------------------------------------------------------------------------
    def append_output_token(self, token_id: int, now: float | None = None) -> RequestStatus | None:
        """Append a sampled token; return the finished status if it ends the request, else None."""
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.time() if now is None else now
        return self.check_stop()

    def check_stop(self) -> RequestStatus | None:
        params = self.sampling_params
        n_out = len(self.output_token_ids)
        if n_out >= params.min_tokens and n_out and self.output_token_ids[-1] in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if n_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
