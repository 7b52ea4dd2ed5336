"""What the engine hands back: :class:`RequestOutput`, and incremental detokenization for streams."""

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

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding the whole list each time.

    Decodes a short window ``tokens[prefix:]`` and subtracts the decode of ``tokens[prefix:read]``, so that
    tokenizers whose output depends on neighbouring tokens (leading spaces, multi-byte characters split
    across tokens) produce exactly the text of a full decode. A window ending in an incomplete UTF-8
    sequence is held back until the next token completes it.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        self.tokens.extend(new_ids)
        prefix_text = self._decode(self.tokens[self._prefix : self._read])
        new_text = self._decode(self.tokens[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.tokens)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Flush what was held back; afterwards ``text`` equals a full decode whenever that extends it."""
        full = self._decode(self.tokens)
        if full.startswith(self.text):
            delta = full[len(self.text) :]
            self.text = full
            return delta
        return ""


class StopStringChecker:
    """Finds the first stop string completed by a request's newest tokens.

    Like HF's ``StopStringCriteria`` a match counts once it ends inside the new text, even if it starts in
    the prompt's last tokens or the last token carries text past it. Special tokens are decoded, so a stop
    string may name one.
    """

    PROMPT_TAIL = 8  # prompt tokens decoded ahead of the output, for matches that start in the prompt

    def __init__(self, tokenizer, stops: list[str], prompt_token_ids: list[int]) -> None:
        self.stops = stops
        self.longest = max(len(s) for s in stops)
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        self._detok.add(prompt_token_ids[-self.PROMPT_TAIL :])
        self._checked = len(self._detok.text)
        self._seen = 0

    def update(self, output_token_ids: list[int]) -> str | None:
        new = output_token_ids[self._seen :]
        self._seen = len(output_token_ids)
        self._detok.add(new)
        text = self._detok.text
        start = max(0, self._checked - self.longest + 1)
        window = text[start:]
        for stop in self.stops:
            i = window.find(stop)
            while i >= 0:
                if start + i + len(stop) > self._checked:
                    return stop
                i = window.find(stop, i + 1)
        self._checked = len(text)
        return None


class DeltaTracker:
    """Turns one completion's cumulative outputs into token and text deltas."""

    def __init__(self, tokenizer, hold: int) -> None:
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.hold = hold
        self.sent = 0
        self.emitted = 0

    def delta(self, completion) -> tuple[list[int], str | None]:
        new = completion.token_ids[self.sent :]
        self.sent += len(new)
        if self.detok is None:
            return new, None
        self.detok.add(new)
        if completion.finished:
            self.detok.finish()
            final = completion.text if completion.stop_str else self.detok.text
            text, self.emitted = final[self.emitted :], len(final)
            return new, text
        safe = max(self.emitted, len(self.detok.text) - self.hold)
        text, self.emitted = self.detok.text[self.emitted : safe], safe
        return new, text


def delta_output(item: RequestOutput, trackers: list[DeltaTracker]) -> RequestOutput:
    """The deltas of ``item`` since the trackers' previous call (what ``stream`` yields)."""
    completions = []
    for c, tracker in zip(item.outputs, trackers):
        new, text = tracker.delta(c)
        logprobs = c.logprobs[len(c.token_ids) - len(new) :] if c.logprobs is not None else None
        completions.append(CompletionOutput(
            c.index, new, len(new), c.finish_reason, c.cumulative_logprob, logprobs, c.error, c.stop_str, _text=text,
        ))
    return RequestOutput(
        item.request_id, item.prompt_token_ids, completions, item.finished, item.arrival_time,
        item.first_token_time, item.finish_time, item.prompt, item.num_cached_tokens,
    )
