"""The one block manager: which blocks hold each sequence's KV (pure Python).

Used by the engine's scheduler and by :class:`~hf_paged.hf.cache.PagedCache` alike. Sequences are identified by
any hashable id. Every mutator that can run out of blocks has a predicate twin, and running out is normal:
``allocate_slots`` returns None and changes nothing, and the caller preempts.

Sharing: ``fork`` gives a new sequence the same blocks (``ref_cnt`` + 1 each); a prefix hit does the same
with cached blocks. A block with ``ref_cnt > 1`` is never written: a sequence about to write into a shared
block gets a fresh block first, and the copy ``(src, dst)`` that must happen before the forward is queued in
:attr:`KVCacheManager.copies` (copy-on-write). Full blocks are never written again, so only a partially
filled last block is ever copied.

The prefix-cache lookup and hashing (``find_cached_prefix``, ``cache_blocks``, ``reset_prefix_cache``) live in
:mod:`hf_paged.core.prefix_cache`, a mixin of :class:`KVCacheManager`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from hf_paged.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from hf_paged.core.kv_tiers import KVTiers
from hf_paged.core.prefix_cache import PrefixCaching, TokenSource, _TokenList  # noqa: F401 - re-exported

SeqId = Hashable
BlockCopies = list[tuple[int, int]]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class OutOfBlocksError(RuntimeError):
    """A fixed-size pool has fewer free blocks than an operation needs (``PagedCache`` only)."""


class KVCacheManager(PrefixCaching):
    """Block tables of live sequences over one :class:`BlockPool`, plus an optional host pool for swapping.

    Args:
        num_blocks: Device blocks.
        block_size: Tokens per block (a power of two).
        enable_prefix_caching: Hash full computed blocks so later sequences with the same prefix reuse them.
        num_host_blocks: Host (CPU) blocks that swapped-out sequences occupy; 0 disables swapping.
        growable: Grow the device pool instead of failing when it runs out (``PagedCache`` without a fixed
            size). The owner grows its tensors to :attr:`num_blocks` before applying copies.
    """

    GROWTH = 1.5

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        num_host_blocks: int = 0,
        growable: bool = False,
    ) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.host_pool = BlockPool(num_host_blocks, enable_caching=False)
        self.growable = growable
        self.tables: dict[SeqId, list[KVCacheBlock]] = {}
        self.host_tables: dict[SeqId, list[KVCacheBlock]] = {}
        self.hashes: dict[SeqId, list[BlockHash]] = {}  # hashes of each sequence's full computed blocks
        # table entries the model runner holds as they are (diffs, :meth:`take_table_diff`); absent = none
        self._sent: dict[SeqId, int] = {}
        self._pending: dict[SeqId, int] = {}  # entries sent in the step in flight, until :meth:`commit_table_diffs`
        self.copies: BlockCopies = []  # pending copy-on-write copies, applied by the owner of the tensors
        self.uncacheable: set[SeqId] = set()  # sequences whose blocks must not enter the prefix cache
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found cached
        self.peak_used_blocks = 0
        self.tiers: KVTiers | None = None  # host and disk tiers below the pool (set by the engine when it has them)

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.pool.cached.values() if b.ref_cnt == 0)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, seq_id: SeqId) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def take_table_diff(self, seq_id: SeqId) -> tuple[int, list[int]]:
        """``(start, block_ids)``: what changed in the sequence's block table since the last committed diff. The
        model runner keeps its copy of the table: it drops the entries from ``start`` on and appends
        ``block_ids``. Costs the changed entries only, so a step's host work does not grow with context length.

        Two-phase: the diff counts as delivered only once :meth:`commit_table_diffs` says the step ran; a step
        that never reached the runner is sent again from the same ``start`` (applying a diff twice is harmless).
        """
        table = self.tables.get(seq_id, ())
        start = min(self._sent.get(seq_id, 0), len(table))
        self._pending[seq_id] = len(table)
        return start, [b.block_id for b in table[start:]]

    def commit_table_diffs(self, seq_ids: Iterable[SeqId]) -> None:
        """The runner applied these sequences' diffs of the last :meth:`take_table_diff` (the step ran)."""
        for seq_id in seq_ids:
            sent = self._pending.pop(seq_id, None)
            if sent is not None:
                self._sent[seq_id] = sent

    def _changed_from(self, seq_id: SeqId, index: int) -> None:
        for held in (self._sent, self._pending):
            if held.get(seq_id, 0) > index:
                held[seq_id] = index

    def _forget_sent(self, seq_id: SeqId) -> None:
        self._sent.pop(seq_id, None)
        self._pending.pop(seq_id, None)

    def num_allocated_slots(self) -> int:
        return self.pool.num_used_blocks * self.block_size

    def take_copies(self) -> BlockCopies:
        copies, self.copies = self.copies, []
        return copies

    # -- allocation -------------------------------------------------------------------------------
    def _writes_into_shared(self, table: list[KVCacheBlock], num_computed: int, num_new: int) -> list[int]:
        """Indices of shared blocks that this step's tokens ``[num_computed, num_computed + num_new)`` write."""
        if num_new <= 0:
            return []
        bs = self.block_size
        last = min(len(table), cdiv(num_computed + num_new, bs))
        return [i for i in range(num_computed // bs, last) if table[i].ref_cnt > 1]

    def num_new_blocks_needed(
        self, seq_id: SeqId, num_computed: int, num_new: int, cached_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead: int = 0,
    ) -> int:
        """Free blocks :meth:`allocate_slots` would take (new blocks, copy-on-write copies, revived cached ones)."""
        table = self.tables.get(seq_id, [])
        held = len(table) + len(cached_blocks)
        grow = max(0, self.blocks_for_tokens(num_computed + num_new + num_lookahead) - held)
        cow = len(self._writes_into_shared(table, num_computed, num_new + num_lookahead))
        revived = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        return grow + cow + revived

    def can_allocate(self, seq_id: SeqId, num_computed: int, num_new: int, num_lookahead: int = 0) -> bool:
        return self.num_new_blocks_needed(seq_id, num_computed, num_new, (), num_lookahead) <= self.num_free_blocks

    def allocate_slots(
        self,
        seq_id: SeqId,
        num_computed: int,
        num_new: int,
        cached_blocks: Sequence[KVCacheBlock] = (),
        cached_hashes: Sequence[BlockHash] = (),
        num_lookahead: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new`` (+ lookahead) tokens after the sequence's ``num_computed`` tokens.

        ``cached_blocks`` (from :meth:`find_cached_prefix`, for a sequence that holds no blocks yet) are
        taken as its first blocks; ``num_computed`` then counts their tokens. A shared block the new tokens
        would write is first replaced by a private copy (queued in :attr:`copies`).

        Returns the ids of the newly allocated blocks (possibly empty), or None when the pool cannot supply
        them, in which case nothing changes (a growable pool grows instead).
        """
        assert num_new >= 0 and num_lookahead >= 0
        table = self.tables.get(seq_id)
        if cached_blocks:
            assert not table, f"sequence {seq_id!r} already holds blocks; prefix hits are taken at admission"
            assert num_computed == len(cached_blocks) * self.block_size, "num_computed must cover the cached blocks"
        need = self.num_new_blocks_needed(seq_id, num_computed, num_new, cached_blocks, num_lookahead)
        if need > self.pool.num_free_blocks and not self._grow_for(need):
            return None
        if table is None:
            table = self.tables[seq_id] = []
        if cached_blocks:
            self.pool.touch(cached_blocks)
            table.extend(cached_blocks)
            self.hashes[seq_id] = list(cached_hashes)
        # lookahead slots are written too (a draft model's KV), so they must be private as well
        shared = self._writes_into_shared(table, num_computed, num_new + num_lookahead)
        if shared:
            self._changed_from(seq_id, shared[0])
        self._make_private(table, shared, num_computed)
        grow = max(0, self.blocks_for_tokens(num_computed + num_new + num_lookahead) - len(table))
        new_blocks = self.pool.get_new_blocks(grow)
        table.extend(new_blocks)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        return [b.block_id for b in new_blocks]

    def make_private(self, seq_id: SeqId, from_token: int) -> None:
        """Give the sequence private copies of its shared blocks holding tokens at or after ``from_token``."""
        table = self.tables[seq_id]
        shared = [i for i in range(from_token // self.block_size, len(table)) if table[i].ref_cnt > 1]
        if len(shared) > self.pool.num_free_blocks and not self._grow_for(len(shared)):
            raise OutOfBlocksError(f"no free blocks to copy {len(shared)} shared blocks")
        if shared:
            self._changed_from(seq_id, shared[0])
        self._make_private(table, shared, len(table) * self.block_size)

    def _make_private(self, table: list[KVCacheBlock], indices: list[int], num_valid_tokens: int) -> None:
        bs = self.block_size
        for i in indices:
            old = table[i]
            new = self.pool.get_new_blocks(1)[0]
            if i * bs < num_valid_tokens:  # the block holds tokens already: copy them first
                self.copies.append((old.block_id, new.block_id))
            self.pool.free_blocks([old])
            table[i] = new

    def _grow_for(self, need: int) -> bool:
        if not self.growable:
            return False
        self.pool.grow(max(need - self.pool.num_free_blocks, int(self.pool.num_blocks * (self.GROWTH - 1)), 1))
        return True

    # -- sharing and release ----------------------------------------------------------------------
    def fork(self, parent: SeqId, child: SeqId) -> None:
        """``child`` starts with exactly ``parent``'s blocks, shared (copy-on-write on the first write)."""
        assert child not in self.tables and child not in self.host_tables, f"sequence {child!r} already exists"
        table = self.tables[parent]
        self.pool.touch(table)
        self.tables[child] = list(table)
        if parent in self.hashes:
            self.hashes[child] = list(self.hashes[parent])
        if parent in self.uncacheable:
            self.uncacheable.add(child)

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Drop the blocks past the first ``num_tokens`` tokens (speculative rollback, ``crop``)."""
        table = self.tables[seq_id]
        keep = self.blocks_for_tokens(num_tokens)
        dropped = table[keep:]
        del table[keep:]
        self._changed_from(seq_id, keep)
        self.pool.free_blocks(reversed(dropped))
        if seq_id in self.hashes:
            del self.hashes[seq_id][num_tokens // self.block_size :]
        last = table[-1] if table and num_tokens % self.block_size else None
        if last is not None and last.block_hash is not None and last.ref_cnt == 1:
            # cut back to a partial block this sequence will write again: it no longer holds its hash's tokens
            # (a shared one keeps its hash: the next write copies it first)
            self.pool.uncache(last)

    def free(self, seq_id: SeqId) -> None:
        """Release every block of the sequence (device or host); the tail goes first, so a prefix it shares
        with others stays cached longest."""
        table = self.tables.pop(seq_id, None)
        self._forget_sent(seq_id)
        if table:
            self.pool.free_blocks(reversed(table))
        host = self.host_tables.pop(seq_id, None)
        if host:
            self.host_pool.free_blocks(reversed(host))
        self.hashes.pop(seq_id, None)
        self.uncacheable.discard(seq_id)

    # -- swapping ---------------------------------------------------------------------------------
    def can_swap_out(self, seq_id: SeqId) -> bool:
        return 0 < len(self.tables.get(seq_id, ())) <= self.host_pool.num_free_blocks

    def swap_out(self, seq_id: SeqId) -> BlockCopies:
        """Move the sequence's KV to host blocks; returns the ``(device, host)`` copies to run before the
        device blocks are reused. Shared device blocks are copied too (the host copy is the sequence's own)."""
        table = self.tables.pop(seq_id)
        self._forget_sent(seq_id)
        host = self.host_pool.get_new_blocks(len(table))
        self.host_tables[seq_id] = host
        pairs = [(d.block_id, h.block_id) for d, h in zip(table, host)]
        self.pool.free_blocks(reversed(table))
        self.hashes.pop(seq_id, None)  # hashed again from its tokens when it is back in device blocks
        return pairs

    def can_swap_in(self, seq_id: SeqId, num_extra_blocks: int = 0) -> bool:
        return len(self.host_tables[seq_id]) + num_extra_blocks <= self.pool.num_free_blocks

    def swap_in(self, seq_id: SeqId) -> BlockCopies | None:
        """Bring a swapped-out sequence back into fresh device blocks; the ``(host, device)`` copies, or None
        when the device pool has too few free blocks (nothing changes then)."""
        host = self.host_tables[seq_id]
        if len(host) > self.pool.num_free_blocks:
            return None
        table = self.pool.get_new_blocks(len(host))
        self.tables[seq_id] = table
        self._forget_sent(seq_id)
        del self.host_tables[seq_id]
        pairs = [(h.block_id, d.block_id) for h, d in zip(host, table)]
        self.host_pool.free_blocks(reversed(host))
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        return pairs

    # -- invariants -------------------------------------------------------------------------------
    def check_consistency(self) -> None:
        """Assert every device and host block is free or held exactly ``ref_cnt`` times, and no table repeats
        a block."""
        for tables in (self.tables, self.host_tables):
            for seq_id, table in tables.items():
                assert len({b.block_id for b in table}) == len(table), f"sequence {seq_id!r} holds a block twice"
        self.pool.check_consistency(b.block_id for table in self.tables.values() for b in table)
        self.host_pool.check_consistency(b.block_id for table in self.host_tables.values() for b in table)
        if self.tiers is not None:
            self.tiers.check_consistency()
        for seq_id, hashes in self.hashes.items():
            table = self.tables.get(seq_id, ())
            assert len(hashes) <= len(table), f"sequence {seq_id!r} has hashes for blocks it does not hold"
            for i, h in enumerate(hashes):
                if table[i].block_hash is not None:
                    assert table[i].block_hash == h, f"sequence {seq_id!r} block {i} hash differs from its chain"
