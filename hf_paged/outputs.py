"""What the engine hands back: :class:`RequestOutput` (one per request and step), its :class:`CompletionOutput` samples, and :class:`EngineStats`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    """One generated sequence of a request (one of its ``n`` samples, or a beam).

    ``token_ids`` is a snapshot taken without copying: the engine only ever appends to a sequence, so the
    output keeps a reference and a length, and slices on first access.

    Attributes:
        index: Which of the request's samples (0 .. n-1).
        token_ids: Generated token ids (the stop token included when the sequence stopped on one).
        text: Decoded ``token_ids`` (special tokens skipped; cut before a matched stop string) when the
            engine knows a tokenizer, else None.
        finish_reason: "stop", "length", "abort", "error", or None while running.
        cumulative_logprob: Sum of the tokens' log-probabilities when ``logprobs`` was asked for, else None.
        logprobs: Per token, ``{token_id: logprob}`` of the sampled token and the most likely alternatives.
        error: Why the sequence failed (``finish_reason == "error"``).
    """

    index: int
    _source: list[int] = field(repr=False)
    _length: int = field(repr=False)
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    _logprobs_source: list[dict[int, float]] | None = field(default=None, repr=False)
    error: str | None = None
    stop_str: str | None = field(default=None, repr=False)
    _text: str | None = field(default=None, repr=False)
    _tokenizer: Any = field(default=None, repr=False, compare=False)
    _tokens: list[int] | None = field(default=None, repr=False)

    @property
    def token_ids(self) -> list[int]:
        if self._tokens is None:
            self._tokens = self._source[: self._length]
        return self._tokens

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        src = self._logprobs_source
        return None if src is None else src[: self._length]

    @property
    def text(self) -> str | None:
        # Decoded on first access: a batch job that only reads finished outputs never pays for the rest.
        if self._text is None and self._tokenizer is not None:
            text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
            if self.stop_str is not None:
                cut = text.find(self.stop_str)
                text = text[:cut] if cut >= 0 else text
            self._text = text
        return self._text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SpecDecodeStats:
    """Speculative decoding of one request (all its samples), or of the engine.

    Attributes:
        num_drafts: Verifications (steps that checked drafts).
        num_draft_tokens: Draft tokens proposed.
        num_accepted_tokens: Draft tokens accepted.
        accepted_per_position: Accepted drafts at each draft position (index 0: the first draft of a step).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step emits on average: 1 + accepted drafts per verification (vLLM's measure)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @classmethod
    def of(cls, seqs) -> SpecDecodeStats | None:
        """The sum over sequences' counts (None where none of them speculated)."""
        total = cls()
        for seq in seqs:
            drafts, tokens, accepted = seq.spec_counts
            total.num_drafts += drafts
            total.num_draft_tokens += tokens
            total.num_accepted_tokens += accepted
            for i, n in enumerate(seq.spec_accepted_per_position):
                if i == len(total.accepted_per_position):
                    total.accepted_per_position.append(0)
                total.accepted_per_position[i] += n
        return total if total.num_drafts else None


@dataclass
class RequestOutput:
    """The state of one request.

    From ``generate`` and ``step``, each completion's ``token_ids`` and ``text`` are everything generated
    so far. From ``stream`` they are the delta since the previous yield. ``token_ids``, ``text`` and
    ``finish_reason`` are the first completion's (the only one when ``n == 1``).

    Attributes:
        request_id: The request's id.
        prompt_token_ids: The prompt as token ids.
        outputs: One :class:`CompletionOutput` per sample (``n``), in index order.
        finished: Every completion has finished.
        arrival_time, first_token_time, finish_time: ``time.time()`` stamps.
        prompt: The prompt text, when it was given as text.
        num_cached_tokens: Prompt tokens whose KV came from the prefix cache.
        spec_decode: Its speculative decoding so far (:class:`SpecDecodeStats`), None where it drafted nothing.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    prompt: str | None = None
    num_cached_tokens: int = 0
    spec_decode: SpecDecodeStats | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.finished or len(self.outputs) == 1 else None


@dataclass
class EngineStats:
    """A snapshot of the engine (``PagedGenerator.stats()``), for metrics endpoints and dashboards."""

    num_running: int  # sequences scheduled or ready to be
    num_waiting: int
    num_swapped: int
    num_kv_blocks: int
    num_kv_blocks_used: int
    num_kv_blocks_cached: int  # free blocks that still hold a cached prefix
    kv_usage: float  # used / total
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of those, found cached
    num_preemptions: dict[str, int]  # by mode: "recompute", "swap"
    num_prompt_tokens: int  # prompt tokens of admitted requests
    num_generated_tokens: int
    num_requests_finished: int
    num_steps: int
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    kv_tiers: dict[str, int] = field(default_factory=dict)  # KV tiers' counters (hits per tier, bytes, evictions)

    @classmethod
    def collect(cls, sched, kv, num_finished: int, num_steps: int) -> EngineStats:
        """The counters of a scheduler and its KV cache manager, now."""
        return cls(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            num_kv_blocks=kv.num_blocks,
            num_kv_blocks_used=kv.num_used_blocks,
            num_kv_blocks_cached=kv.num_cached_free_blocks,
            kv_usage=kv.pool.usage,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_preemptions=dict(sched.num_preemptions),
            num_prompt_tokens=sched.num_prompt_tokens,
            num_generated_tokens=sched.num_generated_tokens,
            num_requests_finished=num_finished,
            num_steps=num_steps,
            spec_num_drafts=sched.spec_num_drafts,
            spec_num_draft_tokens=sched.spec_num_draft_tokens,
            spec_num_accepted_tokens=sched.spec_num_accepted_tokens,
            spec_accepted_per_position=list(sched.spec_accepted_per_position),
            kv_tiers=kv.tiers.stats() if getattr(kv, "tiers", None) is not None else {},
        )

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """1 + accepted drafts per verification (0 before any)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0
