"""The KV tiers' disk tier under tensor parallelism: every rank keeps the files of its own shard's KV heads, and a
block counts as cached from disk only when every rank read a good file for it.

Each rank's :class:`~hf_paged.executor.kv_tiers.TierStore` has its own folder under ``prefix_cache_dir`` (the
fingerprint includes the rank and the world size, so a folder written by one layout never serves another, nor one
rank the other's shard). Saves need no agreement: the step's ``save`` moves reach every rank with the step, and each
rank's writer thread writes its own bytes in the background.

Loads do: rank 0's scheduler looks a prefix up block by block (:meth:`~hf_paged.core.kv_tiers.KVTiers.promote`),
and a block it counts as cached is never computed again, on any rank. So rank 0 asks every rank to read its file
of the block into the same host slot (:class:`DiskLoad`, sent to the workers the way a step is), and the ranks agree
with an all-reduce MIN: the block is a hit only if every rank's file passed its checks. Otherwise the prefix
stops there, the ranks whose file was good delete it too (one good file without its partner is of no use), and
every rank writes the recomputed block again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from hf_paged.executor.kv_tiers import TierStore

logger = logging.getLogger(__name__)


@dataclass
class DiskLoad:
    """Every rank: read your file of ``block_hash`` into host ``slot``, then agree whether all ranks could."""

    block_hash: bytes
    slot: int


@dataclass
class DiskReadAhead:
    """Every rank: start reading these blocks' files in the background (a request arrived)."""

    block_hashes: list[bytes]


@dataclass
class DiskFlush:
    """Every rank: wait until your queued files are written, then meet the others (all-reduce)."""


def load_and_agree(store: TierStore | None, block_hash: bytes, slot: int, agree: Callable[[int], int]) -> bool:
    """This rank's part of a :class:`DiskLoad`: read, agree, and delete a good file whose partner on another rank is
    missing or bad. Never raises before the all-reduce (a rank that skipped it would leave the others waiting)."""
    ok = False
    try:
        ok = store is not None and store.load(block_hash, slot)
    except Exception:  # noqa: BLE001 - an unreadable block is a miss, like a file that fails its checks
        logger.warning("prefix cache: reading block %s failed; it is recomputed", block_hash.hex(), exc_info=True)
    everyone = bool(agree(int(ok)))
    if ok and not everyone:
        store.discard(block_hash)
    return everyone


def serve_tier_message(store: TierStore | None, message, agree: Callable[[int], int]) -> bool:
    """A worker rank: run ``message`` if it is one of this module's (True), else leave it (False)."""
    if isinstance(message, DiskLoad):
        load_and_agree(store, message.block_hash, message.slot, agree)
    elif isinstance(message, DiskReadAhead):
        if store is not None:
            store.read_ahead(message.block_hashes)
    elif isinstance(message, DiskFlush):
        if store is not None:
            store.flush()
        agree(1)
    else:
        return False
    return True


class ShardedTierStore:
    """Rank 0's store as the scheduler sees it under tensor parallelism (the
    :class:`hf_paged.core.kv_tiers.TierStore` protocol): the host tier is rank 0's index over every rank's slots,
    as in one process; disk loads, read-aheads and flushes run on every rank.

    Args:
        inner: Rank 0's own store.
        collective: Runs a function that sends a message to the workers and meets them (the executor's guarded
            path: a failed collective fails the group, logged once).
        broadcast: Sends one message to every worker rank.
        agree: All-reduce MIN over the ranks.
        failed: Whether the group has failed (then nothing is asked of the workers: every lookup misses, and the
            step that follows fails its requests with the group's error).
    """

    def __init__(self, inner: TierStore, collective: Callable, broadcast: Callable, agree: Callable[[int], int],
                 failed: Callable[[], bool]) -> None:
        self.inner = inner
        self.num_host_slots = inner.num_host_slots
        self._collective = collective
        self._broadcast = broadcast
        self._agree = agree
        self._failed = failed

    # rank 0's parts, as in one process (the tests and the benchmark read them)
    @property
    def host(self):
        return self.inner.host

    @property
    def disk(self):
        return self.inner.disk

    @property
    def has_disk(self) -> bool:
        return self.inner.has_disk

    def disk_has(self, block_hash: bytes) -> bool:
        """Rank 0's file exists (a cheap first check; :meth:`load` is where every rank's file is checked)."""
        return self.inner.disk_has(block_hash)

    def _ask(self, run: Callable):
        """Run ``run`` with the workers; None when the group has failed (now or before)."""
        if self._failed():
            return None
        try:
            return self._collective(run)
        except Exception:  # noqa: BLE001 - the executor logged it and shut the group down; the step fails next
            return None

    def load(self, block_hash: bytes, slot: int) -> bool:
        def run() -> bool:
            self._broadcast(DiskLoad(block_hash, slot))  # first: the workers read while rank 0 does
            return load_and_agree(self.inner, block_hash, slot, self._agree)

        return bool(self._ask(run))

    def read_ahead(self, block_hashes: list[bytes]) -> None:
        if not self.inner.has_disk:
            return
        self.inner.read_ahead(block_hashes)
        self._ask(lambda: self._broadcast(DiskReadAhead(list(block_hashes))))

    def flush(self) -> None:
        """Wait until every rank's queued files are written."""
        def run() -> None:
            self._broadcast(DiskFlush())
            self.inner.flush()
            self._agree(1)

        if self.inner.has_disk:
            self._ask(run)

    def drop_disk(self) -> None:
        self.inner.drop_disk()  # no more loads or saves are planned: the workers' files go unused

    def counters(self) -> dict[str, int]:
        """Rank 0's byte and file counters (every rank reads and writes as many files, of its own heads)."""
        return self.inner.counters()

    # the step's moves and the end are rank 0's executor's, as in one process
    def demote(self, moves) -> None:
        self.inner.demote(moves)

    def promote(self, moves) -> None:
        self.inner.promote(moves)

    def save(self, moves) -> None:
        self.inner.save(moves)

    def discard(self, block_hash: bytes) -> None:
        self.inner.discard(block_hash)

    def close(self) -> None:
        self.inner.close()
