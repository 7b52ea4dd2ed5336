"""Block tables of the rows of one ``generate`` batch, over the one block manager (pure Python).

The bookkeeping half of :class:`hf_paged.hf.cache.PagedCache`.
"""

from __future__ import annotations

import itertools
from collections import Counter

from hf_paged.core.kv_cache_manager import BlockCopies, KVCacheManager, OutOfBlocksError, cdiv


class RowTables:
    """The rows of one ``generate`` batch as sequences of a :class:`KVCacheManager` (pure bookkeeping).

    Rows all hold ``num_tokens`` tokens. Rows share blocks after a beam reorder, a ``repeat_interleave`` or
    while they write identical K/V; a block is written only by rows that all hold it and all write the same
    values, anyone else copies it first. Methods that move blocks return the ``(src, dst)`` copies the
    caller applies to every layer before writing.

    Args:
        block_size: tokens per block.
        num_blocks: fixed pool size (running out raises :class:`OutOfBlocksError`); None: the pool starts
            empty and grows by at least half its size whenever a step needs more blocks than are free.
    """

    def __init__(self, block_size: int, num_blocks: int | None = None) -> None:
        self.kv = KVCacheManager(num_blocks or 0, block_size, growable=num_blocks is None)
        self.block_size = block_size
        self.fixed = num_blocks is not None
        self.rows: list[int] = []  # sequence id of each row
        self._ids = itertools.count()
        self.num_tokens = 0

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.kv.num_used_blocks

    @property
    def peak_used_blocks(self) -> int:
        return self.kv.peak_used_blocks

    @property
    def pool(self):
        return self.kv.pool

    def block_ids(self, row: int) -> list[int]:
        return self.kv.get_block_ids(self.rows[row])

    def same_table_groups(self) -> list[list[int]]:
        """Rows grouped by identical block tables, groups and rows in row order."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for row in range(self.num_rows):
            groups.setdefault(tuple(self.block_ids(row)), []).append(row)
        return list(groups.values())

    def start(self, num_rows: int) -> None:
        """Open ``num_rows`` empty tables (the first step of a batch)."""
        assert not self.rows and self.num_tokens == 0, "start() on a batch that already has rows"
        self.rows = [next(self._ids) for _ in range(num_rows)]

    def append(self, num_new_tokens: int, classes: list[list[int]]) -> BlockCopies:
        """Make room for ``num_new_tokens`` more tokens in every row.

        Args:
            num_new_tokens: tokens every row writes this step.
            classes: a partition of the rows; the rows of one class hold identical tables and write identical
                K/V this step, so they keep sharing one set of blocks (written once, through the first row).
        """
        if num_new_tokens == 0:
            return []
        assert sorted(r for cls in classes for r in cls) == list(range(self.num_rows)), f"{classes} is no partition"
        start = self.num_tokens
        num_new = cdiv(start + num_new_tokens, self.block_size) - cdiv(start, self.block_size)
        # A partial last block held by k classes is copied by all but the last of them to write into it.
        holders = Counter(self.block_ids(cls[0])[-1] for cls in classes) if start % self.block_size else Counter()
        self._reserve(len(classes) * num_new + sum(k - 1 for k in holders.values()))
        for cls in classes:
            leader = self.rows[cls[0]]
            assert all(self.block_ids(r) == self.block_ids(cls[0]) for r in cls), f"class {cls} mixes block tables"
            for r in cls[1:]:  # the class writes once, through its leader, and shares the result again
                self.kv.free(self.rows[r])
            allocated = self.kv.allocate_slots(leader, start, num_new_tokens)  # not inside the assert: -O strips it
            assert allocated is not None
            for r in cls[1:]:
                self.kv.fork(leader, self.rows[r])
        self.num_tokens = start + num_new_tokens
        return self.kv.take_copies()

    def fork(self, row: int, from_token: int) -> BlockCopies:
        """Give ``row`` private copies of its shared blocks holding tokens at or after ``from_token``."""
        self._reserve(sum(1 for b in self.kv.tables[self.rows[row]][from_token // self.block_size :] if b.ref_cnt > 1))
        self.kv.make_private(self.rows[row], from_token)
        return self.kv.take_copies()

    def select(self, rows: list[int]) -> None:
        """New row ``i`` takes old row ``rows[i]``'s table (beam reorder, batch select, repeat-interleave).

        Only references move: the new tables share the old rows' blocks, copied later only if a row writes
        into a partially filled shared block.
        """
        for r in rows:
            if not 0 <= r < self.num_rows:
                raise ValueError(f"row index {r} out of range for a batch of {self.num_rows} rows")
        new = [next(self._ids) for _ in rows]
        for seq_id, r in zip(new, rows):
            self.kv.fork(self.rows[r], seq_id)
        for seq_id in self.rows:
            self.kv.free(seq_id)
        self.rows = new

    def crop(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of every row; blocks past them are released."""
        assert 0 <= num_tokens <= self.num_tokens, f"crop to {num_tokens} of {self.num_tokens} tokens"
        for seq_id in self.rows:
            self.kv.truncate(seq_id, num_tokens)
        self.num_tokens = num_tokens

    def reset(self) -> None:
        """Release every row; the pool (and its capacity) stays."""
        for seq_id in self.rows:
            self.kv.free(seq_id)
        self.rows = []
        self.num_tokens = 0

    def check_consistency(self) -> None:
        """Assert every block is free or referenced exactly once per table holding it, and table lengths."""
        want = cdiv(self.num_tokens, self.block_size)
        for row in range(self.num_rows):
            assert len(self.block_ids(row)) == want, f"row {row} holds {len(self.block_ids(row))} blocks, not {want}"
        assert set(self.kv.tables) == set(self.rows) or self.num_tokens == 0, "tables of rows that do not exist"
        self.kv.check_consistency()

    def _reserve(self, n: int) -> None:
        free = self.kv.num_free_blocks
        if n <= free:
            return
        if self.fixed:
            raise OutOfBlocksError(
                f"the KV pool is out of blocks: a step needs {n}, {free} of num_blocks={self.num_blocks} are free; "
                "pass a larger num_blocks (or max_tokens), or leave both unset to let the pool grow"
            )
        self.kv._grow_for(n)
