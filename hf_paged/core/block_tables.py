"""Block tables of the rows of one batch, sharing blocks copy-on-write (pure Python).

The bookkeeping half of :class:`hf_paged.hf.paged_cache.PagedCache`. Rows are the batch rows of a stock
``generate`` call; they all hold ``num_tokens`` tokens. Rows share blocks after a beam reorder, a
``repeat_interleave`` or while they write identical K/V (the ``num_beams`` copies of a prompt). Shared blocks
always form a common prefix of the sharing tables, and a block is written only by rows that all hold it
and all write the same values; anyone else copies it first. Every method that moves blocks returns the
``(src, dst)`` block copies the caller must apply to every layer's K/V before writing.
"""

from __future__ import annotations

from collections import Counter

from hf_paged.core.block_pool import BlockPool, KVCacheBlock
from hf_paged.core.kv_cache_manager import cdiv

BlockCopies = list[tuple[int, int]]


class OutOfBlocksError(RuntimeError):
    """A fixed-size pool has fewer free blocks than a step needs."""


class BatchBlockTables:
    """One block table per batch row over one :class:`BlockPool`.

    Args:
        block_size: tokens per block.
        num_blocks: fixed pool size; running out raises :class:`OutOfBlocksError`. ``None``: the pool
            starts empty and grows by at least half its size whenever a step needs more blocks than are free.
    """

    GROWTH = 1.5

    def __init__(self, block_size: int, num_blocks: int | None = None) -> None:
        self.block_size = block_size
        self.fixed = num_blocks is not None
        self.pool: BlockPool | None = BlockPool(num_blocks) if num_blocks is not None else None
        self.tables: list[list[KVCacheBlock]] = []
        self.num_tokens = 0
        self.peak_used_blocks = 0

    # -- queries --

    @property
    def num_rows(self) -> int:
        return len(self.tables)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks if self.pool is not None else 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - (self.pool.num_free_blocks if self.pool is not None else 0)

    def block_ids(self, row: int) -> list[int]:
        return [b.block_id for b in self.tables[row]]

    def same_table_groups(self) -> list[list[int]]:
        """Rows grouped by identical block tables, groups and rows in row order."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for row, table in enumerate(self.tables):
            groups.setdefault(tuple(b.block_id for b in table), []).append(row)
        return list(groups.values())

    # -- mutators --

    def start(self, num_rows: int) -> None:
        """Open ``num_rows`` empty tables (the first step of a batch)."""
        assert not self.tables and self.num_tokens == 0, "start() on a batch that already has rows"
        self.tables = [[] for _ in range(num_rows)]

    def append(self, num_new_tokens: int, classes: list[list[int]]) -> BlockCopies:
        """Make room for ``num_new_tokens`` more tokens in every row.

        Args:
            num_new_tokens: tokens every row writes this step.
            classes: a partition of the rows; the rows of one class hold identical tables and write identical
                K/V this step, so they keep sharing one set of blocks (written once, through the first row).

        Returns:
            The ``(src, dst)`` copies of partially filled shared last blocks (copy-on-write).
        """
        if num_new_tokens == 0:
            return []
        rows = sorted(r for cls in classes for r in cls)
        assert rows == list(range(self.num_rows)), f"classes {classes} do not partition {self.num_rows} rows"
        for cls in classes:
            assert all(self.tables[r] == self.tables[cls[0]] for r in cls), f"class {cls} mixes block tables"
        start, end = self.num_tokens, self.num_tokens + num_new_tokens
        num_new = cdiv(end, self.block_size) - cdiv(start, self.block_size)
        partial = start % self.block_size != 0
        # A partial last block shared by k classes is copied by all but the last of them to write into it.
        holders = Counter(self.tables[cls[0]][-1].block_id for cls in classes) if partial else Counter()
        self._reserve(len(classes) * num_new + sum(k - 1 for k in holders.values()))

        copies: BlockCopies = []
        for cls in classes:
            table = self.tables[cls[0]]
            if partial and table[-1].ref_cnt > len(cls):
                copies.append(self._replace(cls, len(table) - 1))
            new_blocks = self.pool.get_new_blocks(num_new)
            for _ in range(len(cls) - 1):
                self.pool.incref(new_blocks)
            for r in cls:
                self.tables[r].extend(new_blocks)
        self.num_tokens = end
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return copies

    def fork(self, row: int, from_token: int) -> BlockCopies:
        """Give ``row`` private copies of its shared blocks holding tokens at or after ``from_token``.

        For a row that was expected to write the same K/V as its class this step and turned out not to.
        """
        table = self.tables[row]
        first = from_token // self.block_size
        shared = [i for i in range(first, len(table)) if table[i].ref_cnt > 1]
        self._reserve(len(shared))
        copies = [self._replace([row], i) for i in shared]
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return copies

    def select(self, rows: list[int]) -> None:
        """New row ``i`` takes old row ``rows[i]``'s table (beam reorder, batch select, repeat-interleave).

        Only references move: the new tables share the old rows' blocks, which are copied later, and
        only if a row writes into a partially filled shared block.
        """
        for r in rows:
            if not 0 <= r < self.num_rows:
                raise ValueError(f"row index {r} out of range for a batch of {self.num_rows} rows")
        new_tables = [list(self.tables[r]) for r in rows]
        if self.pool is not None:
            for table in new_tables:
                self.pool.incref(table)
        self._free_tables()
        self.tables = new_tables

    def crop(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of every row; blocks past them are released."""
        assert 0 <= num_tokens <= self.num_tokens, f"crop to {num_tokens} of {self.num_tokens} tokens"
        keep = cdiv(num_tokens, self.block_size)
        for table in self.tables:
            self.pool.free_blocks(reversed(table[keep:]))
            del table[keep:]
        self.num_tokens = num_tokens

    def reset(self) -> None:
        """Release every row; the pool (and its capacity) stays."""
        self._free_tables()
        self.tables = []
        self.num_tokens = 0

    def check_consistency(self) -> None:
        """Assert every block is free or referenced exactly once per table holding it, and table lengths."""
        want = cdiv(self.num_tokens, self.block_size)
        for row, table in enumerate(self.tables):
            assert len(table) == want, f"row {row} holds {len(table)} blocks for {self.num_tokens} tokens"
            assert len({b.block_id for b in table}) == len(table), f"row {row} holds a block twice"
        if self.pool is not None:
            self.pool.check_consistency(b.block_id for table in self.tables for b in table)

    # -- internals --

    def _free_tables(self) -> None:
        if self.pool is not None:
            for table in self.tables:
                # tail first, so the blocks a prefix shares go back to the free queue last
                self.pool.free_blocks(reversed(table))

    def _replace(self, rows: list[int], index: int) -> tuple[int, int]:
        """Swap the block at ``index`` of ``rows`` (identical tables) for a fresh copy they alone share."""
        old = self.tables[rows[0]][index]
        assert old.ref_cnt > len(rows), f"copy of block {old.block_id} that only rows {rows} hold"
        new = self.pool.get_new_blocks(1)[0]
        for _ in range(len(rows) - 1):
            self.pool.incref([new])
        self.pool.free_blocks([old] * len(rows))
        for r in rows:
            self.tables[r][index] = new
        return old.block_id, new.block_id

    def _reserve(self, n: int) -> None:
        free = self.pool.num_free_blocks if self.pool is not None else 0
        if n <= free:
            return
        if self.fixed:
            raise OutOfBlocksError(
                f"the KV pool is out of blocks: a step needs {n}, {free} of num_blocks={self.num_blocks} are free; "
                "pass a larger num_blocks (or max_tokens), or leave both unset to let the pool grow"
            )
        grow = max(n - free, int(self.num_blocks * (self.GROWTH - 1)))
        if self.pool is None:
            self.pool = BlockPool(grow)
        else:
            self.pool.grow(grow)
