"""The runner's grammar matchers: one per structured sequence, advanced on each of its accepted tokens.

Each sampled row of a structured sequence gets its matcher's token bitmask applied to its logits before the
sampler sees them (one batched ``apply_token_bitmask_inplace`` for the step). A matcher lives as long as the
runner's state of its sequence, so it survives preemption (recompute and swap keep the runner's state); a
sequence the runner meets again from scratch (a sample forked while its parent was preempted) replays its
output into a fresh matcher. Speculative verification masks every verified position: the matcher walks the
drafts, fills one mask per position, and rolls back; a draft the grammar forbids is masked out at its own
position, so it is rejected there.

A grammar can reach a state that allows no token at all and cannot end (``a[^\\s\\S]`` after "a"): sampling
from an all ``-inf`` row is impossible, so that sequence fails alone with :func:`dead_end_message`, which names
its constraint. JSON rows also lose every token with a raw control character (``token_mask``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from hf_paged.structured.compiler import import_xgrammar
from hf_paged.structured_params import dead_end_message



class StructuredMatchers:
    """Grammar matchers of the runner's structured sequences, by sequence id."""

    def __init__(self) -> None:
        self.matchers: dict[int, object] = {}
        self.accepted: dict[int, int] = {}  # output tokens each matcher has walked (beams: see follow)
        self.kinds: dict[int, str] = {}  # the constraint's kind, named in a dead end's error
        self.token_masks: dict[int, torch.Tensor] = {}  # int32 [V / 32]: tokens the output may ever contain
        self._bitmask: torch.Tensor | None = None

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.matchers

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def add(self, seq_id: int, compiled, stop_token_ids: Iterable[int], output_token_ids: Sequence[int],
            kind: str = "grammar", token_mask: torch.Tensor | None = None) -> None:
        """A matcher for a sequence new to the runner, replaying what it already generated (a fork).
        ``token_mask`` (int32 ``[V / 32]``) limits every step's allowed tokens (stop tokens always stay allowed)."""
        xgr = import_xgrammar()
        stops = sorted(stop_token_ids)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        self.kinds[seq_id] = kind
        if token_mask is not None:
            token_mask = token_mask.clone()
            for token in stops:  # a request's stop token may hold any bytes: it ends the grammar regardless
                if token < token_mask.shape[0] * 32:
                    token_mask[token // 32] |= _bit(token % 32)
            self.token_masks[seq_id] = token_mask
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
            self.kinds[child] = self.kinds[parent]
            if parent in self.token_masks:
                self.token_masks[child] = self.token_masks[parent]  # read only: shared

    def drop(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            for table in (self.matchers, self.accepted, self.kinds, self.token_masks):
                table.pop(seq_id, None)

    def dead_end(self, seq_id: int, ahead: int = 0) -> str:
        """The error of ``seq_id`` when its grammar allows no token ``ahead`` tokens past those it accepted."""
        return dead_end_message(self.kinds.get(seq_id, "grammar"), self.accepted.get(seq_id, 0) + ahead)

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

    def _restrict(self, bitmask: torch.Tensor, filled: list[tuple[int, int]]) -> list[bool]:
        """AND the token masks of the filled ``(row, seq_id)`` rows into ``bitmask`` (one batched op for the
        step); whether each row still allows some token (False: a dead end)."""
        limited = [(row, self.token_masks[s]) for row, s in filled if s in self.token_masks]
        if limited:
            width = limited[0][1].shape[0]
            index = torch.tensor([row for row, _ in limited])
            bitmask[index, :width] &= torch.stack([mask for _, mask in limited])
        return bitmask[torch.tensor([row for row, _ in filled])].any(dim=1).tolist()

    def mask(self, logits: torch.Tensor, seq_ids: Sequence[int], inplace: bool = False,
             dead: dict[int, str] | None = None) -> torch.Tensor:
        """``logits [N, V]`` (row i: sequence ``seq_ids[i]``) with every structured row masked: in place, or in a
        copy when the caller still needs the raw rows (log-probabilities are the model's, unmasked). A row whose
        grammar allows no token is left unmasked and its sequence's error is put in ``dead`` (the caller must
        not sample it)."""
        filled = [(i, s) for i, s in enumerate(seq_ids) if s in self.matchers and not self.matchers[s].is_terminated()]
        if not filled:
            return logits
        xgr = import_xgrammar()
        bitmask = self._buffer(logits.shape[0], logits.shape[-1])
        for row, seq_id in filled:
            self.matchers[seq_id].fill_next_token_bitmask(bitmask, row)
        masked_rows = []
        for (row, seq_id), alive in zip(filled, self._restrict(bitmask, filled)):
            if alive:
                masked_rows.append(row)
            elif dead is not None:
                dead[seq_id] = self.dead_end(seq_id)
        if not masked_rows:
            return logits
        masked = logits if inplace else logits.clone()
        xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=logits.shape[-1], indices=masked_rows)
        return masked

    def mask_verify(self, logits: torch.Tensor, seq_ids: Sequence[int], drafts: Sequence[list[int]],
                    dead: dict[int, int] | None = None) -> torch.Tensor:
        """Speculative verification: ``logits`` holds ``len(draft) + 1`` rows per sequence; each row is masked
        as if the drafts before it were accepted. Rows after a draft the grammar refuses stay unmasked: that
        draft is masked out at its own row, so verification rejects it and never reads them. A row where the
        grammar allows no token stays unmasked and its position among the sequence's rows goes into ``dead``
        (the first one): a token verified there must not be kept (the sequence fails with :meth:`dead_end`)."""
        bitmask = self._buffer(logits.shape[0], logits.shape[-1])
        filled: list[tuple[int, int]] = []  # (row, seq_id)
        positions: list[int] = []  # drafts walked before each filled row
        offset = 0
        for seq_id, draft in zip(seq_ids, drafts):
            matcher = self.matchers.get(seq_id)
            if matcher is not None and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, offset)
                filled.append((offset, seq_id))
                positions.append(0)
                walked = 0
                for token in draft:
                    if not matcher.accept_token(token):
                        break
                    walked += 1
                    if matcher.is_terminated():
                        break
                    matcher.fill_next_token_bitmask(bitmask, offset + walked)
                    filled.append((offset + walked, seq_id))
                    positions.append(walked)
                if walked:
                    matcher.rollback(walked)
            offset += len(draft) + 1
        rows: list[int] = []
        for (row, seq_id), walked, alive in zip(filled, positions, self._restrict(bitmask, filled) if filled else []):
            if alive:
                rows.append(row)
            elif dead is not None and seq_id not in dead:
                dead[seq_id] = walked
        if not rows:
            return logits
        masked = logits.clone()
        import_xgrammar().apply_token_bitmask_inplace(masked, bitmask, vocab_size=logits.shape[-1], indices=rows)
        return masked


def _bit(position: int) -> int:
    """Bit ``position`` (0..31) of an int32 bitmask word, as a signed int32 value."""
    return (1 << position) - (1 << 32) if position == 31 else 1 << position
