"""The pool of KV blocks: reference counts, a free queue with O(1) removal, and the prefix cache (pure Python).

A block is free exactly when its ``ref_cnt`` is 0; it then sits in the free queue. A free block may still
hold a cached prefix (``block_hash`` set): a prefix hit takes it back out of the middle of the queue.

Free-queue order decides which memory gets reused, and so how much of the pool the process ever touches:

    head                                                                        tail
    [recently freed, no hash (LIFO)] [never used, by id] [cached prefixes, least recently freed first]

Allocation pops from the head: blocks just freed come back first (their pages are already resident), then
untouched blocks, and cached prefixes are evicted last, least recently used first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Chained hash of one full block: (parent block's hash, this block's token ids, extra keys).

    128-bit BLAKE2b, so equal hashes mean equal prefixes for all practical purposes (a 64-bit Python
    ``hash`` would collide once in ~4e9 block pairs and silently serve another prompt's KV).
    """
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


class KVCacheBlock:
    """Bookkeeping for one block of ``block_size`` token slots in every layer's KV pool."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None  # what a cached block holds (checked by tests)
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = ", cached" if self.block_hash is not None else ""
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) push and pop at both ends and removal from the middle."""

    def __init__(self) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def _insert(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} is already queued"
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert(block, self._head, self._head.next_free)

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not self._tail, "pop from an empty free queue"
        self.remove(block)
        return block


class BlockPool:
    """Owns every block, the free queue and the map from block hash to cached block.

    Args:
        num_blocks: Blocks in the pool (ids ``0 .. num_blocks - 1``).
        enable_caching: Keep hashes of freed full blocks so a later prefix can reuse them.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = []
        self.free_queue = FreeBlockQueue()
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        # called with a free cached block just before get_new_blocks reuses it (the KV tiers demote it)
        self.on_evict: Callable[[KVCacheBlock], None] | None = None
        # 1 + the largest block id ever handed out: the storage of blocks past it has never been written
        # (never-used blocks leave the free queue in id order, so this is also how many have been used)
        self.high_water = 0
        if num_blocks:
            self.grow(num_blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.blocks else 0.0

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next allocated) first: for tests and debugging."""
        return [b.block_id for b in self.free_queue]

    def grow(self, n: int) -> None:
        """Add ``n`` free blocks with the next ids, just before the cached region of the free queue.

        For owners whose storage can grow (``PagedCache``); the engine's pool is sized once.
        """
        if n < 1:
            raise ValueError(f"grow needs n >= 1, got {n}")
        start = len(self.blocks)
        new = [KVCacheBlock(i) for i in range(start, start + n)]
        self.blocks.extend(new)
        # never-used blocks go after recently freed ones and before cached ones
        anchor = next((b for b in self.free_queue if b.block_hash is not None), None)
        for block in new:
            if anchor is None:
                self.free_queue.append(block)
            else:
                self.free_queue._insert(block, anchor.prev_free, anchor)

    # -- allocation and sharing -------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue (ref_cnt 1), evicting cached ones if needed.

        The caller checks ``num_free_blocks`` first.
        """
        assert n <= len(self.free_queue), f"asked for {n} blocks with {len(self.free_queue)} free"
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block)
                self._evict(block)
            block.ref_cnt = 1
            if block.block_id >= self.high_water:
                self.high_water = block.block_id + 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (fork, prefix hit); a free cached block leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 join the free queue.

        A block that holds a cached prefix goes to the tail (evicted last), any other block to the head
        (reused first).
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)
                else:
                    self.free_queue.appendleft(block)

    # -- prefix cache -----------------------------------------------------------------------------
    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register a full, computed block under ``block_hash``; False if caching is off or the hash is taken."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block
        return True

    def lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop a held block's hash (its holders keep using it; nobody new will find it)."""
        assert block.ref_cnt > 0, f"uncache of free block {block.block_id}: use reset_prefix_cache"
        self._evict(block)
        self.num_evictions -= 1

    def _evict(self, block: KVCacheBlock) -> None:
        del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix held by no one (their blocks become plain free blocks); the count."""
        freed = [b for b in self.cached.values() if b.ref_cnt == 0]
        for block in freed:
            self.free_queue.remove(block)
            self._evict(block)
            self.free_queue.appendleft(block)
        return len(freed)

    # -- invariants -------------------------------------------------------------------------------
    def check_consistency(self, owned: Iterable[int] = ()) -> None:
        """Assert every block is either free or referenced exactly as many times as it is owned."""
        counts = [0] * self.num_blocks
        for block_id in owned:
            counts[block_id] += 1
        queued = [b.block_id for b in self.free_queue]
        assert len(queued) == len(set(queued)), "a block is in the free queue twice"
        free = set(queued)
        for block in self.blocks:
            assert block.ref_cnt == counts[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but owned {counts[block.block_id]} times"
            )
            assert (block.ref_cnt == 0) == (block.block_id in free), f"block {block.block_id} free-state mismatch"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"block {block.block_id} hash not in the map"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"cached map entry of block {block.block_id} has a stale hash"
