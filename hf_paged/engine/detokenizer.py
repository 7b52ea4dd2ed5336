"""Text from token ids: incremental detokenization, stop-string matching, and the text deltas of a stream."""

from __future__ import annotations

from hf_paged.outputs import CompletionOutput, RequestOutput


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
