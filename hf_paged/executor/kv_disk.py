"""The KV tiers' disk tier: one checksummed file per block under a folder keyed by the engine's fingerprint,
written by a background thread, read ahead by another (:mod:`hf_paged.executor.kv_tiers` drives it)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAGIC = b"HFPKVT01"  # file format version: a change here makes old files foreign (skipped, never misread)
HEADER_LEN_BYTES = 4


class DiskTier:
    """One file per block under ``folder/<fingerprint>/``, written by a background thread.

    A file is ``MAGIC``, a 4-byte little-endian header length, a JSON header (``key``: the block hash,
    ``fingerprint``, ``nbytes``, ``blake2b``: the payload's checksum) and the payload (per layer, the block's
    k then v bytes as the pool holds them). It is written to a temporary name and renamed, so a reader sees
    a whole file or none; a reader still checks everything and skips what does not match.
    """

    def __init__(self, folder: str, fingerprint: str, cap_bytes: int | None, layout: list[tuple[tuple, torch.dtype]]) -> None:
        self.root = Path(folder).expanduser()
        self.dir = self.root / fingerprint
        self.fingerprint = fingerprint
        self.cap_bytes = cap_bytes
        self.layout = layout  # per part (layer k, layer v): shape of one block, dtype
        self.nbytes = sum(_numel(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in layout)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}-{threading.get_ident()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"prefix_cache_dir={folder!r} is not a writable folder: {e}") from e
        self.bytes_read = self.bytes_written = self.files_written = self.files_skipped = 0
        self.files_evicted = self.writes_dropped = 0
        self.stopped: str | None = None  # why writing stopped (disk full), once
        self._warned_skip = False
        self._lock = threading.Lock()
        self._sizes = self._scan() if cap_bytes is not None else {}
        self._queue: queue.Queue = queue.Queue(maxsize=4096)
        self._thread = threading.Thread(target=self._writer, name="hf-paged-kv-disk-writer", daemon=True)
        self._thread.start()
        # read-ahead: blocks read and checked in the background, waiting for the lookup that takes them
        self.ready: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()
        self._inflight: set[bytes] = set()  # asked for, not read yet (a lookup of one waits for it)
        self._cond = threading.Condition()
        self.max_ready = 0  # set by the store: as many blocks as its host tier has slots
        self.blocks_read_ahead = 0  # blocks a lookup took from the read-ahead (no read on the step's path)
        self._reads: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read_ahead, name="hf-paged-kv-disk-reader", daemon=True)
        self._reader.start()

    def path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / f"{name}.kv"

    def has(self, block_hash: bytes) -> bool:
        return self.path(block_hash).is_file()

    # -- reading ----------------------------------------------------------------------------------
    def read(self, block_hash: bytes) -> list[torch.Tensor] | None:
        """The block's parts (per layer k, v), or None for a missing or unusable file (counted, warned once)."""
        path = self.path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        parts = self._parse(data, block_hash)
        if parts is None:
            self.files_skipped += 1
            try:
                path.unlink()  # never a good file: the block is recomputed and written again
            except OSError:
                pass
            if not self._warned_skip:
                self._warned_skip = True
                logger.warning("prefix cache: skipped an unusable file %s (torn, truncated, foreign or corrupt); "
                               "its block is recomputed (further ones are only counted)", path)
            return None
        self.bytes_read += len(data)
        try:
            os.utime(path)  # recently used: the last to go when the folder is over its cap
        except OSError:
            pass
        return parts

    def _parse(self, data: bytes, block_hash: bytes) -> list[torch.Tensor] | None:
        head = len(MAGIC) + HEADER_LEN_BYTES
        if len(data) < head or data[: len(MAGIC)] != MAGIC:
            return None
        hlen = int.from_bytes(data[len(MAGIC) : head], "little")
        try:
            header = json.loads(data[head : head + hlen])
        except (ValueError, UnicodeDecodeError):
            return None
        payload = memoryview(data)[head + hlen :]
        if not isinstance(header, dict) or header.get("key") != block_hash.hex() or (
            header.get("fingerprint") != self.fingerprint or header.get("nbytes") != self.nbytes
            or len(payload) != self.nbytes or hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("blake2b")
        ):
            return None
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        parts, offset = [], 0
        for shape, dt in self.layout:
            n = _numel(shape) * torch.empty((), dtype=dt).element_size()
            parts.append(flat[offset : offset + n].view(dt).reshape(shape))
            offset += n
        return parts

    def discard(self, block_hash: bytes) -> None:
        """Delete the block's file and forget its read-ahead (tensor parallelism: another rank has no good file
        for it, so every rank recomputes the block and writes it again)."""
        with self._cond:
            self.ready.pop(block_hash, None)
        try:
            self.path(block_hash).unlink(missing_ok=True)
        except OSError:
            pass

    def read_ahead(self, block_hashes: list[bytes]) -> None:
        if not self.max_ready:
            return
        with self._cond:
            self._inflight.update(block_hashes)
        self._reads.put(list(block_hashes))

    def take(self, block_hash: bytes) -> list[torch.Tensor] | None:
        """The block's parts: from the read-ahead (waiting for it if it is reading this very block), else read
        now. Each file is read and checked once either way."""
        with self._cond:
            self._cond.wait_for(lambda: block_hash not in self._inflight, timeout=60)
            parts = self.ready.pop(block_hash, None)
        if parts is not None:
            self.blocks_read_ahead += 1
            return parts
        return self.read(block_hash)

    def _read_ahead(self) -> None:
        while True:
            hashes = self._reads.get()
            try:
                if hashes is None:
                    return
                self._read_chain(hashes)
            finally:
                with self._cond:
                    self._inflight.difference_update(hashes or ())
                    self._cond.notify_all()
                self._reads.task_done()

    def _read_chain(self, hashes: list[bytes]) -> None:
        for block_hash in hashes:
            with self._cond:
                known = block_hash in self.ready
            parts = None if known else self.read(block_hash)
            with self._cond:
                if parts is not None:
                    self.ready[block_hash] = parts
                    while len(self.ready) > self.max_ready:
                        self.ready.popitem(last=False)
                self._inflight.discard(block_hash)
                self._cond.notify_all()
            if parts is None and not known:
                return  # a prefix stops at its first missing block

    def wait_reads(self) -> None:
        """Wait until every read-ahead asked for so far is done (tests, benchmarks)."""
        self._reads.join()

    # -- writing ----------------------------------------------------------------------------------
    def submit(self, block_hash: bytes, parts: list[torch.Tensor]) -> None:
        """Queue one block's parts (host tensors nobody else writes) for the writer thread."""
        if self.stopped is not None:
            return
        try:
            self._queue.put_nowait((block_hash, parts))
        except queue.Full:  # the disk is slower than the steps: drop (a later step writes it again if needed)
            self.writes_dropped += 1

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self.stopped is None:
                    self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, parts: list[torch.Tensor]) -> None:
        payload = b"".join(p.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for p in parts)
        header = json.dumps({
            "key": block_hash.hex(), "fingerprint": self.fingerprint, "nbytes": len(payload),
            "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest(),
        }).encode()
        path = self.path(block_hash)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(MAGIC + len(header).to_bytes(HEADER_LEN_BYTES, "little") + header + payload)
            os.replace(tmp, path)  # atomic: readers (other processes too) see the whole file or none
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self.stopped = f"{type(e).__name__}: {e}"
            logger.warning("prefix cache: writing to %s failed (%s); the disk tier stops writing, serving goes on",
                           self.dir, self.stopped)
            return
        size = len(payload) + len(header) + len(MAGIC) + HEADER_LEN_BYTES
        self.bytes_written += size
        self.files_written += 1
        if self.cap_bytes is not None:
            self._enforce_cap(path, size)

    def _scan(self) -> dict[Path, int]:
        """Files already in the folder, least recently used first (for the size cap)."""
        found = []
        for path in self.dir.glob("*/*.kv"):
            try:
                st = path.stat()
            except OSError:
                continue
            found.append((st.st_mtime, path, st.st_size))
        return {path: size for _, path, size in sorted(found)}

    def _enforce_cap(self, path: Path, size: int) -> None:
        with self._lock:
            self._sizes.pop(path, None)
            self._sizes[path] = size
            total = sum(self._sizes.values())
            while total > self.cap_bytes and len(self._sizes) > 1:
                victim = next(iter(self._sizes))
                total -= self._sizes.pop(victim)
                try:
                    victim.unlink()
                    self.files_evicted += 1
                except OSError:
                    pass

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()

    def close(self) -> None:
        if self._reader.is_alive():
            self._reads.put(None)
            self._reader.join(timeout=60)
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60)
        self.ready.clear()


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
