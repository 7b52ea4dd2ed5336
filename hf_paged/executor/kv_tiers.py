"""The bytes of the KV tiers below the pool: a host tier (tensors in host memory) and a disk tier (one
checksummed file per block), moved as :class:`~hf_paged.core.kv_tiers.TierMoves` ask.

The scheduling side (:mod:`hf_paged.core.kv_tiers`) decides what moves; this module moves it:

- ``demote`` (pool block -> host slot) runs before anything else of a step writes into the pool;
- ``promote`` (host slot -> pool block) runs after the step's swaps and copies, before its forward;
- ``save`` (pool block -> file) copies the block's bytes right after the forward and hands them to a writer
  thread, so no file write sits on the step's path;
- ``load`` (file -> host slot) runs when the scheduler's prefix lookup asks, ahead of the step that uses the
  block; a file that fails a check is skipped (counted, one warning) and the block is recomputed.

By default both tiers hold the pool's bytes exactly (an fp32 pool's blocks come back bit for bit, so greedy
output with a tier hit equals a run without one). ``kv_offload_dtype="int8"`` stores an fp16/bf16/fp32 pool's
host tier as int8 rows with a scale (:mod:`hf_paged.kernels.kv_quant`): about 3.8x the blocks of an fp32
pool in the same memory, but a block promoted from it is no longer bit-exact (an int8 pool's bytes are kept
as they are either way).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import torch

from hf_paged.config import EngineConfig
from hf_paged.kernels.kv_quant import dequantize_rows, quantize_rows
from hf_paged.executor.kv_pool import KVPool

logger = logging.getLogger(__name__)

MAGIC = b"HFPKVT01"  # file format version: a change here makes old files foreign (skipped, never misread)
HEADER_LEN_BYTES = 4
GiB = 1 << 30


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_fingerprint(model: torch.nn.Module, cfg: EngineConfig, pool: KVPool, rank: int, world: int) -> str:
    """A digest of everything that changes a block's KV bytes: the model's config and (a sample of) its
    weights, the pool's dtype and layout, the block size, quantization, and the tensor-parallel rank and size.

    The weights are sampled (each tensor's name, shape, dtype and 256 evenly spaced values), so a start costs
    milliseconds, not a pass over every weight; a fine-tune that changes only unsampled values is not told
    apart (give it its own folder).
    """
    h = hashlib.blake2b(digest_size=16)
    config = getattr(model, "config", None)
    settings = {
        "format": MAGIC.decode(), "config": config.to_json_string(use_diff=False) if config is not None else "",
        "dtype": str(pool.specs[0].dtype), "kv_cache_dtype": pool.kv_cache_dtype, "block_size": pool.block_size,
        "layers": [(s.num_kv_heads, s.head_dim, s.row_size) for s in pool.specs],
        "quantization": cfg.quantization, "quant_activations": cfg.quant_activations, "rank": rank, "world": world,
    }
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in model.state_dict().items():
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            flat = t.detach().reshape(-1)
            if flat.numel():
                step = max(1, flat.numel() // 256)
                h.update(flat[::step][:256].to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()


class HostTier:
    """Host-memory copies of pool blocks: per layer ``(k, v)`` tensors ``[num_slots, block_size, num_kv_heads,
    row]`` in the pool's dtype (exact), or int8 rows with a scale (``compress``); pinned when the pool is on
    CUDA, so copies to and from it can overlap."""

    def __init__(self, pool: KVPool, num_slots: int, compress: bool) -> None:
        self.pool = pool
        self.num_slots = num_slots
        self.compress = compress and pool.kv_cache_dtype != "int8"
        pin = pool.device.type == "cuda"
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for k, _ in pool.kv_caches:
            shape = list(k.shape)
            shape[0] = num_slots
            dtype = k.dtype
            if self.compress:
                shape[-1] += 4  # the fp32 scale of each row (kv_quant's format)
                dtype = torch.int8
            self.caches.append(tuple(torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(2)))

    def demote(self, pairs: list[tuple[int, int]]) -> None:
        """Pool block -> host slot, every layer."""
        if not pairs:
            return
        src = torch.tensor([b for b, _ in pairs], device=self.pool.device)
        dst = torch.tensor([s for _, s in pairs])
        for pair, host in zip(self.pool.kv_caches, self.caches):
            for t, h in zip(pair, host):
                rows = t.index_select(0, src)
                if self.compress:
                    rows = quantize_rows(rows)
                h.index_copy_(0, dst, rows.to("cpu"))

    def promote(self, pairs: list[tuple[int, int]]) -> None:
        """Host slot -> pool block, every layer."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([b for _, b in pairs], device=self.pool.device)
        for pair, host in zip(self.pool.kv_caches, self.caches):
            for t, h in zip(pair, host):
                rows = h.index_select(0, src)
                if self.compress:
                    rows = dequantize_rows(rows, t.dtype)
                t.index_copy_(0, dst, rows.to(t.device, non_blocking=t.device.type == "cuda"))

    def write_slot(self, slot: int, parts: list[torch.Tensor]) -> None:
        """Put one block's exact bytes (per layer k then v, as the pool holds them) into ``slot``."""
        for (hk, hv), (k, v) in zip(self.caches, _pairs(parts)):
            for h, part in ((hk, k), (hv, v)):
                h[slot].copy_(quantize_rows(part) if self.compress else part)


def _pairs(parts: list[torch.Tensor]) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    return zip(parts[0::2], parts[1::2])


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


class TierStore:
    """The execution layer's side of the KV tiers (the :class:`hf_paged.core.kv_tiers.TierStore` protocol):
    the host tier, the disk tier, and the moves of each step.

    Args:
        pool: The KV pool whose blocks move.
        cfg: ``kv_offload_gb``, ``kv_offload_dtype``, ``prefix_cache_dir``, ``prefix_cache_disk_gb``.
        fingerprint: :func:`kv_fingerprint` of this engine (rank).
        max_model_len: With a disk tier and no host tier, the host slots that stage disk reads hold one
            longest prompt.
        agree: Tensor parallelism: makes the ranks agree on the slot count (every rank runs the same moves).
    """

    def __init__(self, pool: KVPool, cfg: EngineConfig, fingerprint: str, max_model_len: int, agree=None) -> None:
        slots = int(cfg.kv_offload_gb * GiB) // max(1, pool.bytes_per_block)
        if cfg.prefix_cache_dir is not None:
            slots = max(slots, cdiv(max_model_len, pool.block_size) + 1)
        if agree is not None:  # tensor parallelism: ranks with more KV heads fit fewer slots; the smallest wins
            slots = agree(slots)
        self.num_host_slots = slots
        self.host = HostTier(pool, slots, cfg.kv_offload_dtype == "int8")
        self.disk: DiskTier | None = None
        if cfg.prefix_cache_dir is not None:
            cap = None if cfg.prefix_cache_disk_gb is None else int(cfg.prefix_cache_disk_gb * GiB)
            layout = [(tuple(t.shape[1:]), t.dtype) for pair in pool.kv_caches for t in pair]
            self.disk = DiskTier(cfg.prefix_cache_dir, fingerprint, cap, layout)
            self.disk.max_ready = slots
        self.pool = pool

    @property
    def has_disk(self) -> bool:
        return self.disk is not None

    def disk_has(self, block_hash: bytes) -> bool:
        return self.disk is not None and self.disk.has(block_hash)

    def read_ahead(self, block_hashes: list[bytes]) -> None:
        if self.disk is not None:
            self.disk.read_ahead(block_hashes)

    def load(self, block_hash: bytes, slot: int) -> bool:
        parts = self.disk.take(block_hash) if self.disk is not None else None
        if parts is None:
            return False
        self.host.write_slot(slot, parts)
        return True

    def drop_disk(self) -> None:
        """The weights changed: the files (keyed by the old weights' fingerprint) are no longer this model's."""
        if self.disk is not None:
            logger.warning("model weights changed: the disk prefix cache is off for this engine")
            self.disk.close()
            self.disk = None

    def counters(self) -> dict[str, int]:
        d = self.disk
        return {
            "disk_bytes_read": d.bytes_read if d else 0, "disk_bytes_written": d.bytes_written if d else 0,
            "disk_files_written": d.files_written if d else 0, "disk_files_skipped": d.files_skipped if d else 0,
            "disk_files_evicted": d.files_evicted if d else 0, "disk_writes_dropped": d.writes_dropped if d else 0,
            "disk_blocks_read_ahead": d.blocks_read_ahead if d else 0,
        }

    # -- a step's moves ---------------------------------------------------------------------------
    def demote(self, moves) -> None:
        if moves is not None:
            self.host.demote(moves.demote)

    def promote(self, moves) -> None:
        if moves is not None:
            self.host.promote(moves.promote)

    def save(self, moves) -> None:
        """After the forward: copy each saved block's bytes out of the pool and queue them for the writer."""
        if moves is None or not moves.save or self.disk is None:
            return
        for block_id, block_hash in moves.save:
            parts = [t[block_id].to("cpu", copy=True) for pair in self.pool.kv_caches for t in pair]
            self.disk.submit(block_hash, parts)

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def make_tier_store(
    model: torch.nn.Module, cfg: EngineConfig, pool: KVPool, max_model_len: int, agree=None
) -> TierStore | None:
    """The KV tiers' store for this engine (this rank), or None when ``kv_offload_gb`` and ``prefix_cache_dir``
    are both unset. An unwritable folder is a ValueError here, at the engine's start."""
    if not cfg.kv_offload_gb and cfg.prefix_cache_dir is None:
        return None
    rank, world = 0, 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    fingerprint = kv_fingerprint(model, cfg, pool, rank, world) if cfg.prefix_cache_dir is not None else ""
    return TierStore(pool, cfg, fingerprint, max_model_len, agree)
