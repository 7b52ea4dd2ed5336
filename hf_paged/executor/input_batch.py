"""The model runner's persistent per-sequence block tables, and a step packed as one ragged batch.

The scheduler sends each block table as a diff (``block_ids_from``, ``new_block_ids``); :class:`BlockTables`
keeps every live sequence's table as a Python list (for the slots of the step's new tokens) and as a row of
one int32 tensor (the step's ``block_tables`` are gathered rows: one copy in C, no Python loop over blocks).
So the host work of a step grows with its new tokens and its sequences, not with their context length.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hf_paged.core.scheduler_output import ScheduledSequence


class BlockTables:
    """Every live sequence's block table, kept from step to step and updated from diffs."""

    def __init__(self) -> None:
        self.lists: dict[int, list[int]] = {}
        self._rows: dict[int, int] = {}
        self._free_rows: list[int] = []
        self._tensor = torch.zeros(16, 16, dtype=torch.int32)  # [rows, max blocks], 0 past each table's end

    def apply(self, item: ScheduledSequence) -> None:
        """Keep the first ``block_ids_from`` entries of the sequence's table, then append ``new_block_ids``."""
        table = self.lists.setdefault(item.seq_id, [])
        start, new = item.block_ids_from, item.new_block_ids
        if start > len(table):
            raise RuntimeError(
                f"block table diff of sequence {item.seq_id} starts at entry {start}, but the runner holds "
                f"{len(table)} (a diff was lost: a bug, please report)"
            )
        if start == len(table) and not new:
            return
        row = self._row(item.seq_id)
        old_len = len(table)
        del table[start:]
        table.extend(new)
        end = start + len(new)
        if end > self._tensor.shape[1]:
            grown = torch.zeros(self._tensor.shape[0], max(end, 2 * self._tensor.shape[1]), dtype=torch.int32)
            grown[:, : self._tensor.shape[1]] = self._tensor
            self._tensor = grown
        if new:
            self._tensor[row, start:end] = torch.tensor(new, dtype=torch.int32)
        if old_len > end:
            self._tensor[row, end:old_len] = 0

    def drop(self, seq_id: int) -> None:
        self.lists.pop(seq_id, None)
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._tensor[row].zero_()
            self._free_rows.append(row)

    def gather(self, seq_ids: list[int], width: int) -> torch.Tensor:
        """``[len(seq_ids), width]`` int32: the sequences' tables, in this order, padded with 0."""
        rows = [self._rows.get(s, -1) for s in seq_ids]
        if min(rows, default=0) < 0:
            raise KeyError(f"no block table for sequences {[s for s, r in zip(seq_ids, rows) if r < 0]}")
        return self._tensor[:, :width].index_select(0, torch.tensor(rows, dtype=torch.long))

    def _row(self, seq_id: int) -> int:
        row = self._rows.get(seq_id)
        if row is None:
            if not self._free_rows:
                n = self._tensor.shape[0]
                grown = torch.zeros(2 * n, self._tensor.shape[1], dtype=torch.int32)
                grown[:n] = self._tensor
                self._tensor = grown
                self._free_rows.extend(range(2 * n - 1, n - 1, -1))
            row = self._rows[seq_id] = self._free_rows.pop()
        return row


def pack_step(
    scheduled: list[ScheduledSequence], tables: Mapping[int, list[int]], block_size: int
) -> tuple[list[int], list[int], list[int], list[int], list[int], list[int]]:
    """Pure-Python packing: token ids, positions, slots, seq_lens, cu_seqlens_q, sampled rows."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    cu = [0]
    sample_rows: list[int] = []
    for item in scheduled:
        start, end = item.start, item.seq_len
        ids.extend(item.token_ids)
        positions.extend(range(start, end))
        table = tables[item.seq_id]
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        seq_lens.append(end)
        cu.append(cu[-1] + item.num_new_tokens)
        if item.sample:  # a verified sequence needs the logits of its last token and of every draft
            sample_rows.extend(range(cu[-1] - 1 - item.num_draft_tokens, cu[-1]))
    return ids, positions, slots, seq_lens, cu, sample_rows


def table_tensor(scheduled: list[ScheduledSequence], tables: Mapping[int, list[int]]) -> torch.Tensor:
    """``[num_seqs, max_blocks]`` int32 built from lists (small batches: a draft model's)."""
    rows = [tables[item.seq_id] for item in scheduled]
    width = max(len(t) for t in rows)
    return torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.int32)
