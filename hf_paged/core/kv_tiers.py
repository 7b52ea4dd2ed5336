"""KV tiers below the pool: which cached blocks go to the host tier and the disk tier, and which come back
(pure Python; the bytes are moved by the execution layer, :mod:`hf_paged.executor.kv_tiers`).

The pool keeps a cached prefix while its block is free and unclaimed; when allocation reuses such a block
(:meth:`~hf_paged.core.block_pool.BlockPool.get_new_blocks`), the block is *demoted*: its bytes are copied to a
slot of the host tier before the step that overwrites them. A prefix lookup that misses in the pool falls
through to the host tier, then to the disk tier, and *promotes* what it finds: a fresh pool block gets the
block's hash at once and the copy ``host slot -> pool block`` runs before the step's forward, so the rest of
the engine sees an ordinary pool hit. A disk hit is read and verified *during* the lookup (into a host slot):
a file that fails its checks is a miss, recomputed, never served.

Every full block a step computes is also *saved* (written through to disk, in the background) when a disk
tier is configured, so a later process on the same folder finds it.

Tiers are inclusive: a promoted block keeps its host slot (least recently used first out), so a promotion
that is cancelled (its pool block evicted again within the same schedule) loses nothing. Within one step,
the slots written by demotions and read by promotions are pinned: a later choice never reuses them before
the step's moves have run (demotions run first, then promotions, then the forward, then the saves).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from hf_paged.core.block_pool import BlockHash, BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from hf_paged.core.kv_cache_manager import KVCacheManager, TokenSource
    from hf_paged.core.scheduler_output import SchedulerOutput


MAX_REMEMBERED_SAVES = 1 << 16


class TierStore(Protocol):
    """What the tiers need from the execution layer's store (:class:`hf_paged.executor.kv_tiers.TierStore`)."""

    num_host_slots: int
    has_disk: bool

    def disk_has(self, block_hash: BlockHash) -> bool:
        """Whether a file for ``block_hash`` exists (it may still fail its checks in :meth:`load`)."""

    def load(self, block_hash: BlockHash, slot: int) -> bool:
        """Read and verify the file of ``block_hash`` into host ``slot``; False (counted) if it is unusable (under
        tensor parallelism: if any rank's file is), and then the file is gone: the recomputed block is saved again."""

    def read_ahead(self, block_hashes: list[BlockHash]) -> None:
        """Start reading (and checking) these blocks' files in the background, in order, up to the first
        missing one; :meth:`load` then takes them from memory. Never blocks."""

    def drop_disk(self) -> None:
        """Stop using the disk tier (the weights changed: its files hold the old weights' KV)."""

    def counters(self) -> dict[str, int]:
        """Byte and file counters of the store (bytes read/written, files skipped, ...)."""


@dataclass
class TierMoves:
    """One step's tier work, carried to execution by :class:`~hf_paged.core.scheduler_output.SchedulerOutput`."""

    demote: list[tuple[int, int]] = field(default_factory=list)  # (pool block, host slot): first
    promote: list[tuple[int, int]] = field(default_factory=list)  # (host slot, pool block): after the demotions
    save: list[tuple[int, BlockHash]] = field(default_factory=list)  # (pool block, hash): to disk, after the forward

    def __bool__(self) -> bool:
        return bool(self.demote or self.promote or self.save)


class KVTiers:
    """The host tier's index (hash -> slot, least recently used first) and the tier moves of the next step.

    Args:
        pool: The device pool whose evicted cached blocks are demoted (this object hooks its evictions).
        store: The execution layer's store: the host slots, the disk files.
    """

    def __init__(self, pool: BlockPool, store: TierStore) -> None:
        self.pool = pool
        self.store = store
        self.host: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self.free_slots = list(range(store.num_host_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.moves = TierMoves()
        self._busy: set[int] = set()  # host slots this step's moves read or write
        self._promoted: dict[int, int] = {}  # pool block id -> index in moves.promote, this step
        self._saved: set[BlockHash] = set()  # hashes written (or queued) to disk by this process
        self.hits = {"host": 0, "disk": 0}  # blocks promoted from each tier
        self.num_demotions = 0
        self.num_host_evictions = 0  # host entries dropped to make room (still on disk if it has them)
        self.num_disk_misses = 0  # files found but unusable (checks failed): recomputed
        pool.on_evict = self._on_evict

    # -- demotion ---------------------------------------------------------------------------------
    def _on_evict(self, block: KVCacheBlock) -> None:
        """The pool is about to reuse a free cached block: keep its bytes in the host tier."""
        index = self._promoted.pop(block.block_id, None)
        if index is not None:
            # promoted in this very schedule and taken back before the copy ran: cancel the copy (the host
            # slot still holds the bytes, tiers are inclusive)
            self.moves.promote[index] = (-1, -1)
            return
        block_hash = block.block_hash
        if block_hash in self.host:
            self.host.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self.moves.demote.append((block.block_id, slot))
        self.host[block_hash] = slot
        self.num_demotions += 1

    def _take_slot(self) -> int | None:
        """A host slot to write this step: a free one, else the least recently used one not pinned."""
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((h for h, s in self.host.items() if s not in self._busy), None)
            if victim is None:
                return None
            slot = self.host.pop(victim)
            self.num_host_evictions += 1
        self._busy.add(slot)
        return slot

    # -- promotion --------------------------------------------------------------------------------
    def promote(
        self, block_hash: BlockHash, token_ids: Sequence[int], chain: list[KVCacheBlock]
    ) -> KVCacheBlock | None:
        """A pool block holding ``block_hash``'s KV (from the host tier, else from disk), or None.

        ``chain``: the blocks the caller's lookup found before this one; they are held while a pool block is
        taken, so that taking it never evicts one of them. The block returned is cached and free, like any
        pool hit; its bytes arrive with the step's moves.
        """
        slot = self.host.get(block_hash)
        tier = "host"
        if slot is None:
            if not self.store.has_disk or not self.store.disk_has(block_hash):
                return None
            slot = self._take_slot()
            if slot is None:
                return None
            if not self.store.load(block_hash, slot):
                self.num_disk_misses += 1
                self._saved.discard(block_hash)  # its file is gone (or useless): the recompute writes it again
                self._busy.discard(slot)
                self.free_slots.append(slot)
                return None
            self.host[block_hash] = slot
            tier = "disk"
        self.host.move_to_end(block_hash)
        # pinned before a pool block is taken: that may evict a cached block whose demotion needs a slot,
        # and it must not be this one
        self._busy.add(slot)
        held = [b for b in chain if b.ref_cnt == 0]
        self.pool.touch(held)
        try:
            if self.pool.num_free_blocks < 1:
                return None
            block = self.pool.get_new_blocks(1)[0]
        finally:
            self.pool.free_blocks(reversed(held))  # back to the cached tail, the prefix's head last
        self.pool.cache_block(block, block_hash, token_ids)
        self._promoted[block.block_id] = len(self.moves.promote)
        self.moves.promote.append((slot, block.block_id))
        self.pool.free_blocks([block])
        self.hits[tier] += 1
        return block

    def read_ahead(self, kv: KVCacheManager, tokens: TokenSource) -> None:
        """A request arrived: have the store read its prefix's files from disk while it waits (the blocks the
        pool and the host tier do not hold; its lookup then finds them in memory)."""
        if not self.store.has_disk or not kv.pool.enable_caching:
            return
        wanted = []
        for i in range((tokens.num_tokens - 1) // kv.block_size):
            block_hash = chain_hash(kv, tokens, i)
            if kv.pool.lookup(block_hash) is None and block_hash not in self.host:
                wanted.append(block_hash)
        if wanted:
            self.store.read_ahead(wanted)

    # -- saving -----------------------------------------------------------------------------------
    def plan_saves(self, kv: KVCacheManager, out: SchedulerOutput, sequences: dict) -> None:
        """Queue to disk the full blocks this step's forward completes (their tokens are all known now; draft
        tokens are not, they are verified after the step)."""
        if not self.store.has_disk or not kv.pool.enable_caching:
            return
        bs = kv.block_size
        for item in out.scheduled:
            seq = sequences.get(item.seq_id)
            table = kv.tables.get(item.seq_id)
            if seq is None or table is None or item.seq_id in kv.uncacheable:
                continue
            end = (item.start + len(item.token_ids) - item.num_draft_tokens) // bs
            for i in range(item.start // bs, min(end, len(table))):
                block_hash = chain_hash(kv, seq, i)
                if len(self._saved) > MAX_REMEMBERED_SAVES:
                    self._saved.clear()  # only a guard against saving twice before the file exists
                if block_hash in self._saved or self.store.disk_has(block_hash):
                    self._saved.add(block_hash)
                    continue
                self._saved.add(block_hash)
                self.moves.save.append((table[i].block_id, block_hash))

    # -- the step ---------------------------------------------------------------------------------
    def take_moves(self) -> TierMoves:
        """This step's moves (for its :class:`SchedulerOutput`); the next step starts a fresh list."""
        moves, self.moves = self.moves, TierMoves()
        moves.promote = [p for p in moves.promote if p[0] >= 0]
        self._busy.clear()
        self._promoted.clear()
        return moves

    def reset(self) -> None:
        """The weights changed: nothing in the host tier is valid any more (the disk tier is keyed by a
        fingerprint of the weights taken at start, so the execution layer stops using it)."""
        # every slot is free again: a demotion still queued writes into a slot nobody indexes (and reset runs
        # between steps, when no promotion is pending)
        self.free_slots = list(range(self.store.num_host_slots - 1, -1, -1))
        self.host.clear()
        self._saved.clear()
        self.store.drop_disk()

    def stats(self) -> dict[str, int]:
        """Counters for :class:`~hf_paged.outputs.EngineStats`: hits per tier (blocks), demotions, evictions,
        and the store's byte and file counters."""
        return {
            "host_hits": self.hits["host"], "disk_hits": self.hits["disk"], "demotions": self.num_demotions,
            "host_evictions": self.num_host_evictions, "disk_misses": self.num_disk_misses,
            "host_blocks": len(self.host), **self.store.counters(),
        }

    def check_consistency(self) -> None:
        """Assert every host slot is either free or indexed once."""
        used = list(self.host.values())
        assert len(used) == len(set(used)), "a host slot holds two hashes"
        assert not set(used) & set(self.free_slots), "a host slot is both free and used"
        assert len(used) + len(self.free_slots) == self.store.num_host_slots, "a host slot is lost"


def chain_hash(kv: KVCacheManager, tokens: TokenSource, i: int) -> BlockHash:
    """Hash of full block ``i`` of ``tokens`` (a sequence keeps its hashes: each is computed once)."""
    known = getattr(tokens, "block_hashes", None)
    if known is not None and i < len(known):
        return known[i]
    start = len(known) if known is not None else 0
    parent = known[start - 1] if start else None
    for j in range(start, i + 1):
        parent = kv._block_hash(tokens, j, parent, ())
    return parent
