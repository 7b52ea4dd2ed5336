"""The runner's grammar matchers: one per structured sequence, advanced on each of its accepted tokens.

Each sampled row of a structured sequence gets its matcher's token bitmask applied to its logits before the
sampler sees them (one batched ``apply_token_bitmask_inplace`` for the step). A matcher lives as long as the
runner's state of its sequence, so it survives preemption (recompute and swap keep the runner's state); a
sequence the runner meets again from scratch (a sample forked while its parent was preempted) replays its
output into a fresh matcher. Speculative verification masks every verified position: the matcher walks the
drafts, fills one mask per position, and rolls back; a draft the grammar forbids is masked out at its own
position, so it is rejected there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from hf_paged.structured.compiler import import_xgrammar


class StructuredMatchers:
    """Grammar matchers of the runner's structured sequences, by sequence id."""

    def __init__(self) -> None:
        self.matchers: dict[int, object] = {}
        self.accepted: dict[int, int] = {}  # output tokens each matcher has walked (beams: see follow)
        self._bitmask: torch.Tensor | None = None

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.matchers

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def add(self, seq_id: int, compiled, stop_token_ids: Iterable[int], output_token_ids: Sequence[int]) -> None:
        """A matcher for a sequence new to the runner, replaying what it already generated (a fork)."""
        xgr = import_xgrammar()
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids))
        walked = 0
        for token in output_token_ids:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break  # the scheduler stopped it there (or it was not generated under this grammar)
            walked += 1
        self.matchers[seq_id] = matcher
        self.accepted[seq_id] = walked

    def fork(self, parent: int, child: int) -> None:
        """Sample ``child`` of an n > 1 request starts from its parent's grammar state."""
        if parent in self.matchers:
            self.matchers[child] = self.matchers[parent].fork()
            self.accepted[child] = self.accepted[parent]

    def drop(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self.matchers.pop(seq_id, None)
            self.accepted.pop(seq_id, None)

    def accept(self, seq_id: int, tokens: Sequence[int]) -> str | None:
        """Advance ``seq_id``'s matcher over its new tokens; an error message if the grammar refuses one."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return None
        for token in tokens:
            if matcher.is_terminated():
                return None  # a stop token ended it: the scheduler drops what follows
            if not matcher.accept_token(token):
                return f"token {token} breaks the request's structured output grammar"
            self.accepted[seq_id] += 1
        return None

    def follow(self, seq_id: int, prompt_len: int, start: int, token_ids: Sequence[int]) -> None:
        """A beam's matcher catches up with the tokens its search appended: the step runs ``token_ids`` at
        positions ``start ..``; those past the prompt that the matcher has not walked yet are accepted (a
        recompute repeats walked ones; a beam new to the runner replayed its output in :meth:`add`)."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return
        for i, token in enumerate(token_ids):
            if start + i - prompt_len == self.accepted[seq_id] and not matcher.is_terminated():
                if matcher.accept_token(token):
                    self.accepted[seq_id] += 1

    def _buffer(self, rows: int, vocab: int) -> torch.Tensor:
        xgr = import_xgrammar()
        if self._bitmask is None or self._bitmask.shape[0] < rows or self._bitmask.shape[1] * 32 < vocab:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 8), vocab)
        return self._bitmask[:rows]

    def _apply(self, logits: torch.Tensor, filled: list[tuple[int, object]], inplace: bool) -> torch.Tensor:
        """``logits`` with row ``i`` masked by ``matcher``'s next-token bitmask for each ``(i, matcher)``."""
        if not filled:
            return logits
        xgr = import_xgrammar()
        bitmask = self._buffer(logits.shape[0], logits.shape[-1])
        for row, matcher in filled:
            matcher.fill_next_token_bitmask(bitmask, row)
        masked = logits if inplace else logits.clone()
        xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=logits.shape[-1],
                                        indices=[row for row, _ in filled])
        return masked

    def mask(self, logits: torch.Tensor, seq_ids: Sequence[int], inplace: bool = False) -> torch.Tensor:
        """``logits [N, V]`` (row i: sequence ``seq_ids[i]``) with every structured row masked: in place, or in a
        copy when the caller still needs the raw rows (log-probabilities are the model's, unmasked)."""
        filled = [(i, self.matchers[s]) for i, s in enumerate(seq_ids)
                  if s in self.matchers and not self.matchers[s].is_terminated()]
        return self._apply(logits, filled, inplace)

    def mask_verify(self, logits: torch.Tensor, seq_ids: Sequence[int], drafts: Sequence[list[int]]) -> torch.Tensor:
        """Speculative verification: ``logits`` holds ``len(draft) + 1`` rows per sequence; each row is masked
        as if the drafts before it were accepted. Rows after a draft the grammar refuses stay unmasked: that
        draft is masked out at its own row, so verification rejects it and never reads them."""
        bitmask = self._buffer(logits.shape[0], logits.shape[-1])
        rows: list[int] = []
        offset = 0
        for seq_id, draft in zip(seq_ids, drafts):
            matcher = self.matchers.get(seq_id)
            if matcher is not None and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, offset)
                rows.append(offset)
                walked = 0
                for token in draft:
                    if not matcher.accept_token(token):
                        break
                    walked += 1
                    if matcher.is_terminated():
                        break
                    matcher.fill_next_token_bitmask(bitmask, offset + walked)
                    rows.append(offset + walked)
                if walked:
                    matcher.rollback(walked)
            offset += len(draft) + 1
        if not rows:
            return logits
        masked = logits.clone()
        import_xgrammar().apply_token_bitmask_inplace(masked, bitmask, vocab_size=logits.shape[-1], indices=rows)
        return masked
