"""The bytes of the KV tiers below the pool: a host tier (tensors in host memory) and a disk tier (one
checksummed file per block), moved as :class:`~hf_paged.core.kv_tiers.TierMoves` ask.

The scheduling side (:mod:`hf_paged.core.kv_tiers`) decides what moves; this module moves it:

- ``demote`` (pool block -> host slot) runs before anything else of a step writes into the pool;
- ``promote`` (host slot -> pool block) runs after the step's swaps and copies, before its forward;
- ``save`` (pool block -> file) copies the block's bytes right after the forward and hands them to a writer
  thread, so no file write sits on the step's path;
- ``read_ahead`` (files -> memory) starts when a request arrives, in the disk tier's reader thread;
  ``load`` (-> host slot) runs when the scheduler's prefix lookup asks, ahead of the step that uses the block,
  taking what was read ahead; a file that fails a check is skipped (counted, one warning) and the block is
  recomputed (:mod:`hf_paged.executor.kv_disk`).

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
from collections.abc import Iterable

import torch

from hf_paged.config import EngineConfig
from hf_paged.kernels.kv_quant import dequantize_rows, quantize_rows
from hf_paged.executor.kv_disk import MAGIC, DiskTier
from hf_paged.executor.kv_pool import KVPool

logger = logging.getLogger(__name__)

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

    def discard(self, block_hash: bytes) -> None:
        """Delete this rank's file of ``block_hash`` (another rank could not read its own)."""
        if self.disk is not None:
            self.disk.discard(block_hash)

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
