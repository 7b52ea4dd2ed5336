"""The pool of KV blocks: a FIFO free queue plus a reference count per block (pure Python)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class KVCacheBlock:
    """Bookkeeping for one block of ``block_size`` token slots in every layer's KV pool."""

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class BlockPool:
    """Owns every block. A block is free exactly when its ``ref_cnt`` is 0 and it sits in the free queue.

    Allocation pops from the head of the free queue, freeing appends to the tail, so a freed block is
    reused as late as possible (what a prefix cache wants).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free queue, head first (for tests and debugging)."""
        return list(self._free)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the free queue (ref_cnt 1). The caller checks availability first."""
        assert n <= len(self._free), f"asked for {n} blocks with {len(self._free)} free"
        out = []
        for _ in range(n):
            block = self.blocks[self._free.popleft()]
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
            out.append(block)
        return out

    def incref(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Share blocks (fork, prefix hit): they stay allocated until every holder frees them."""
        for block in blocks:
            assert block.ref_cnt > 0, f"incref on free block {block.block_id}"
            block.ref_cnt += 1

    def grow(self, n: int) -> None:
        """Add ``n`` free blocks, ids ``num_blocks .. num_blocks + n - 1``, at the tail of the free queue.

        For owners whose storage can grow (``PagedCache``); the engine's pool is sized once.
        """
        if n < 1:
            raise ValueError(f"grow needs n >= 1, got {n}")
        start = self.num_blocks
        self.blocks.extend(KVCacheBlock(i) for i in range(start, start + n))
        self._free.extend(range(start, start + n))
        self.num_blocks += n

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the tail of the free queue in order."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block.block_id)

    def check_consistency(self, owned: Iterable[int] = ()) -> None:
        """Assert every block is either free or referenced as many times as it is owned."""
        counts = [0] * self.num_blocks
        for block_id in owned:
            counts[block_id] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free queue twice"
        for block in self.blocks:
            assert block.ref_cnt == counts[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but owned {counts[block.block_id]} times"
            )
            assert (block.ref_cnt == 0) == (block.block_id in free), f"block {block.block_id} free-state mismatch"
