"""What the engine hands back: :class:`RequestOutput`, and incremental detokenization for streams."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    """The state of one request.

    From ``generate`` and ``step``, ``token_ids`` and ``text`` are everything generated so far. From
    ``stream`` they are the delta since the previous yield.

    Attributes:
        request_id: The request's id.
        prompt_token_ids: The prompt as token ids.
        token_ids: Generated token ids (the stop token included when the request stopped on one).
        text: Decoded ``token_ids`` (special tokens skipped) when the engine knows a tokenizer, else None.
        finish_reason: "stop", "length", "abort", or None while running.
        arrival_time, first_token_time, finish_time: ``time.time()`` stamps.
        prompt: The prompt text, when it was given as text.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    prompt: str | None = None
    _text: str | None = field(default=None, repr=False)
    _tokenizer: Any = field(default=None, repr=False, compare=False)

    @property
    def text(self) -> str | None:
        # Decoded on first access: a batch job that only reads finished outputs never pays for the rest.
        if self._text is None and self._tokenizer is not None:
            self._text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return self._text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
