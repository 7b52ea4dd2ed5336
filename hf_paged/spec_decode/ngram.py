"""N-gram (prompt lookup) proposer: copy what followed an earlier occurrence of the sequence's suffix.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens of prompt + output are
looked up among the n-grams that occurred before; the tokens that followed the most recent earlier
occurrence are the drafts (continuing with the same period when they run into the suffix itself, so a
repeating pattern drafts k tokens of its repetition). Each sequence keeps an index ``n-gram -> position where it last ended``, grown
incrementally as tokens arrive, so a lookup costs O(max - min) whatever the length (pure Python).
"""

from __future__ import annotations

from hf_paged.spec_decode.proposer import DraftRequest


class _Index:
    __slots__ = ("last_end", "indexed")

    def __init__(self) -> None:
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in the index


class NgramProposer:
    relative_cost = 0.0  # a dictionary lookup: drafting costs no forward time

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._indices: dict[int, _Index] = {}

    def forget(self, finished, preempted=()) -> None:
        for seq_id in finished:
            self._indices.pop(seq_id, None)

    def propose(self, requests: list[DraftRequest], num_tokens: list[int], tables=None) -> list[list[int]]:
        return [self.propose_one(r.seq_id, r.prompt_token_ids + r.output_token_ids, k) for r, k in zip(requests, num_tokens)]

    def propose_one(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        index = self._indices.setdefault(seq_id, _Index())
        last = len(tokens) - 1
        # index every n-gram ending before the last token (the suffix must match an earlier occurrence)
        for end in range(index.indexed, last):
            for n in range(self.min_n, self.max_n + 1):
                if end + 1 >= n:
                    index.last_end[tuple(tokens[end + 1 - n : end + 1])] = end
        index.indexed = max(index.indexed, last)
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            end = index.last_end.get(tuple(tokens[last + 1 - n :]))
            if end is not None:
                # copy what followed; a match just behind the suffix repeats with its period (a a a -> a a)
                period = last - end
                return [tokens[end + 1 + i] if end + 1 + i <= last else tokens[end + 1 + (i % period)] for i in range(k)]
        return []
