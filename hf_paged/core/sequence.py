"""A sequence being generated and its life cycle (pure Python: no torch, no transformers)."""

from __future__ import annotations

import enum
import time

from hf_paged.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # recompute: back in the waiting queue, its KV dropped
    SWAPPED = "swapped"  # its KV copied to host blocks, waiting to come back
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


class Sequence:
    """One sequence being generated: the unit the scheduler schedules.

    A user request with ``n > 1`` samples (or a beam search) owns several sequences: they share the user's
    ``request_id`` and differ in ``index`` and ``seq_id``. The first is prefilled alone; at its first
    sampling point the others are forked from it and share its blocks.

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
        priority: int = 0,
        seq_id: int | None = None,
        index: int = 0,
        lora_int_id: int = 0,
    ) -> None:
        self.request_id = request_id
        self.seq_id = seq_id  # assigned by the scheduler when None
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.output_token_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.num_preemptions = 0
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        stop = set(sampling_params.stop_token_ids or ())
        if not sampling_params.ignore_eos:
            stop |= set(eos_token_ids)
        self.stop_token_ids = frozenset(stop)
        self.max_model_len = max_model_len
        self.forked = sampling_params.n == 1  # n > 1: the other samples are forked at the first sample
        self.is_beam = False  # a beam: the runner returns its log-prob row, the beam search picks the token
        self.parked = False  # preempted while waiting for its beam search: not admitted before a new token
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.spec_token_ids: list[int] = []  # drafts to verify next step (from the runner's last output)
        # speculative decoding settings (plain data): proposer key, most drafts, lookahead slots, batch limit
        self.spec_key: str | None = None
        self.spec_k = 0
        self.spec_lookahead = 0
        self.spec_disable_batch_size: int | str | None = None  # "auto": the scheduler's speculation gate
        # its own speculation counts: verifications, drafts, accepted drafts, accepted at each draft position
        self.spec_counts: list[int] = [0, 0, 0]
        self.spec_accepted_per_position: list[int] = []
        self.error: str | None = None  # why a request finished with status FINISHED_ERROR
        # When a list, the sampler appends each step's processed logits row (for HF's output_scores).
        self.scores: list | None = None
        self.block_hashes: list = []  # prefix-cache hashes of its full blocks, computed once (kv_cache_manager)
        self.lora_int_id = lora_int_id  # its LoRA adapter (0: the base model)

    @property
    def hash_extra_keys(self) -> tuple:
        """What besides its tokens keys its KV in the prefix cache: its adapter (KV computed under one adapter
        is never served to another, nor to the base model)."""
        return (("lora", self.lora_int_id),) if self.lora_int_id else ()

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

    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then arrival (vLLM's convention)."""
        return (self.priority, self.arrival_time, self.seq_id or 0)

    # -- state changes ------------------------------------------------------------------------------
    def fork(self, seq_id: int, index: int) -> Sequence:
        """A sibling sample: same prompt and settings, its own id, index and (so far equal) output."""
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id, child.index = seq_id, index
        child.output_token_ids = list(self.output_token_ids)
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.spec_token_ids = []
        child.spec_counts, child.spec_accepted_per_position = [0, 0, 0], []
        child.block_hashes = list(self.block_hashes)
        child.parked = False
        child.scores = None if self.scores is None else list(self.scores)
        return child

    def append_output_token(self, token_id: int, now: float | None = None) -> SequenceStatus | None:
        """Append a sampled token; return the finished status if it ends the request, else None."""
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.time() if now is None else now
        return self.check_stop()

    def check_stop(self) -> SequenceStatus | None:
        params = self.sampling_params
        n_out = len(self.output_token_ids)
        if n_out >= params.min_tokens and n_out and self.output_token_ids[-1] in self.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if n_out >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, seq={self.seq_id}, index={self.index}, status={self.status.value}, "
            f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
