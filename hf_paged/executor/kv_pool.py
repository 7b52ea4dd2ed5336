"""The paged KV pool: per-layer ``k_cache``/``v_cache`` tensors, how many blocks to give them, and the
block moves the scheduler asks for (copy-on-write copies, swapping to and from host memory)."""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from dataclasses import dataclass, field

import torch

from hf_paged.attention.function import METADATA_KWARG, KVLayoutProbe
from hf_paged.attention.layer import AttentionFacts
from hf_paged.kernels.kv_quant import check_kv_cache_dtype, row_size
from hf_paged.model.hf_config import text_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerKVSpec:
    """One layer's K/V: heads, head size, the model's dtype, and how the pool stores them ("auto": in ``dtype``;
    "int8": rows of int8 values and an fp32 scale, :mod:`hf_paged.kernels.kv_quant`). ``attention``: what the
    layer passes to the attention function, for the engine's attention layer objects (None in a spec made by
    hand, which serves no step)."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    attention: AttentionFacts | None = field(default=None, compare=False)

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.int8 if self.kv_cache_dtype == "int8" else self.dtype

    @property
    def row_size(self) -> int:
        """Last dimension of the pool tensors (``head_dim``, plus the scale's 4 bytes for int8)."""
        return row_size(self.head_dim) if self.kv_cache_dtype == "int8" else self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.row_size * torch.empty((), dtype=self.cache_dtype).element_size()


def probe_kv_layout(model: torch.nn.Module, kv_cache_dtype: str = "auto") -> list[LayerKVSpec]:
    """Run one token through the model to learn every attention layer's K/V shape and dtype (and its
    attention settings: :class:`~hf_paged.attention.layer.AttentionFacts`).

    Works for any architecture that routes attention through the interface, whatever its config calls
    heads and head sizes. ``kv_cache_dtype`` ("auto" or "int8") is how the pool will store them.
    """
    check_kv_cache_dtype(kv_cache_dtype)
    probe = KVLayoutProbe()
    device = next(model.parameters()).device
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False, **{METADATA_KWARG: probe})
    _check_probe(model, probe)
    specs = [LayerKVSpec(*probe.layers[i], kv_cache_dtype, probe.facts[i]) for i in range(max(probe.layers) + 1)]
    if kv_cache_dtype == "int8":
        for s in specs:
            row_size(s.head_dim)  # NotImplementedError for a head_dim the int8 rows cannot hold
    return specs


def _check_probe(model: torch.nn.Module, probe: KVLayoutProbe) -> None:
    """Raise NotImplementedError, naming the class, for what the paged engine cannot serve exactly."""
    name = type(model).__name__
    if probe.unindexed:
        raise NotImplementedError(f"{name} has attention modules without layer_idx")
    if not probe.layers:
        raise NotImplementedError(
            f"{name} does not pass keyword arguments through to its attention function; "
            "hf_paged needs that to hand each layer its paged metadata"
        )
    if probe.sinks:
        raise NotImplementedError(f"{sorted(probe.sinks)[0]} uses attention sinks, which hf_paged does not support yet")
    repeated = sorted(i for i, n in probe.calls.items() if n > 1)
    if repeated:
        raise NotImplementedError(
            f"{name}: {probe.modules[repeated[0]]} calls the attention function {probe.calls[repeated[0]]} times "
            "per layer (e.g. differential attention); hf_paged keeps one KV pool per layer and supports one call"
        )
    cfg = text_config(model)
    num_layers = getattr(cfg, "num_hidden_layers", None)
    n = max(max(probe.layers) + 1, num_layers or 0)
    missing = sorted(set(range(n)) - set(probe.layers))
    if missing:
        raise NotImplementedError(
            f"{name}: decoder layers {missing} do not call the attention function (recurrent, convolution or "
            "state-space layers, as in hybrid models); their per-sequence state is not paged, hf_paged "
            "supports models whose every layer is attention"
        )


def kv_bytes_per_token(specs: list[LayerKVSpec]) -> int:
    return sum(s.bytes_per_token for s in specs)


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    import psutil

    return psutil.virtual_memory().available


def copy_blocks(caches, pairs: list[tuple[int, int]], dst_caches=None) -> None:
    """Copy whole blocks ``src -> dst`` in every layer (``dst_caches``: another pool of the same layout)."""
    if not pairs:
        return
    dst_caches = caches if dst_caches is None else dst_caches
    for (k, v), (dk, dv) in zip(caches, dst_caches):
        src = torch.tensor([s for s, _ in pairs], device=k.device)
        dst = torch.tensor([d for _, d in pairs], device=dk.device)
        # host-to-device may overlap; device-to-host must not (the CPU reads the buffer right away)
        non_blocking = dk.device.type == "cuda"
        dk.index_copy_(0, dst, k.index_select(0, src).to(dk.device, non_blocking=non_blocking))
        dv.index_copy_(0, dst, v.index_select(0, src).to(dv.device, non_blocking=non_blocking))


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in, writable, leaving their contents as they are
COMMIT_CHUNK_BYTES = 32 << 20  # pool pages committed ahead of use at a time (all layers together)


class _PageCommitter:
    """Faults in page ranges in bulk with ``madvise(MADV_POPULATE_WRITE)``, split over the intra-op threads.

    A page first touched by a kernel's store costs a fault inside the step (measured ~9 us on a 2-core VM,
    the store being single-threaded); in bulk the same pages cost ~2-5 us each and the threads share them.
    The call never changes memory contents, so committing a range that is already in use is harmless.
    Unavailable (not Linux, an older kernel): :attr:`ok` turns False and pages fault in as they are written.
    """

    def __init__(self) -> None:
        self.ok = True
        try:
            self._madvise = ctypes.CDLL(None, use_errno=True).madvise
            self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            self.ok = False

    def _run(self, ranges: list[tuple[int, int]]) -> None:
        for start, length in ranges:
            if self._madvise(start, length, _MADV_POPULATE_WRITE) != 0:
                self.ok = False  # EINVAL before Linux 5.14; ENOMEM and others: leave it to the first writes
                return

    def commit(self, tensors: list[torch.Tensor]) -> None:
        page = mmap.PAGESIZE
        ranges = []
        for t in tensors:
            start = -(-t.data_ptr() // page) * page
            end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
            if end > start:
                ranges.append((start, end - start))
        if not self.ok or not ranges:
            return
        threads = max(1, min(torch.get_num_threads(), len(ranges)))
        helpers = [threading.Thread(target=self._run, args=(ranges[i::threads],)) for i in range(1, threads)]
        for h in helpers:
            h.start()
        self._run(ranges[::threads])
        for h in helpers:
            h.join()


_COMMITTER = _PageCommitter()


class KVPool:
    """Per-layer ``k_cache``/``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    On CPU the tensors come from ``torch.empty``: the OS hands out pages as they are first touched, so a
    large pool costs no resident memory until it is used. The engine calls :meth:`commit` before each step
    with the scheduler's block high-water mark: never-used blocks are handed out in id order, so the pages of
    the next blocks are faulted in ahead, in bulk, a chunk at a time (resident memory follows use, plus at
    most one chunk). Nothing reads an unwritten slot.

    With ``num_host_blocks`` a second pool of the same layout lives in host memory (pinned on CUDA) for
    sequences swapped out under memory pressure; on a CPU device it is simply a second buffer.

    An int8 pool (``kv_cache_dtype="int8"``) holds int8 tensors ``[num_blocks, block_size, num_kv_heads,
    head_dim + 4]``: each row's values and its fp32 scale side by side, so block copies and swaps move the
    scales with the values (format: :mod:`hf_paged.kernels.kv_quant`).
    """

    def __init__(
        self, specs: list[LayerKVSpec], num_blocks: int, block_size: int, device: torch.device, num_host_blocks: int = 0
    ) -> None:
        self.specs = specs
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.device = device
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # blocks below this have their pages committed (on a device other than the CPU: all of them)
        self.committed = 0 if device.type == "cpu" else num_blocks
        pin = device.type == "cuda"
        for spec in specs:
            shape = (num_blocks, block_size, spec.num_kv_heads, spec.row_size)
            dt = spec.cache_dtype
            self.kv_caches.append((torch.empty(shape, dtype=dt, device=device), torch.empty(shape, dtype=dt, device=device)))
            if num_host_blocks:
                host = (num_host_blocks, *shape[1:])
                self.host_caches.append((torch.empty(host, dtype=dt, pin_memory=pin), torch.empty(host, dtype=dt, pin_memory=pin)))

    def commit(self, high_water: int) -> None:
        """Fault in the pages of blocks ``committed .. high_water - 1``, and on to the end of a chunk of
        :data:`COMMIT_CHUNK_BYTES`, before a step writes them (contents untouched)."""
        if high_water <= self.committed:
            return
        chunk = max(1, COMMIT_CHUNK_BYTES // max(1, self.bytes_per_block))
        end = min(self.num_blocks, max(high_water, self.committed + chunk))
        _COMMITTER.commit([t[self.committed:end] for pair in self.kv_caches for t in pair])
        self.committed = end

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: device block ``src`` to device block ``dst`` in every layer."""
        copy_blocks(self.kv_caches, pairs)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block -> host block, in every layer."""
        copy_blocks(self.kv_caches, pairs, self.host_caches)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host block -> device block, in every layer."""
        copy_blocks(self.host_caches, pairs, self.kv_caches)

    def supports_native(self) -> bool:
        """Whether the native CPU attention kernel can read this pool (CPU, fp32/bf16/fp16/int8, contiguous)."""
        return all(
            k.device.type == "cpu" and k.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8)
            and k.is_contiguous()
            for k, _ in self.kv_caches
        )

    @property
    def kv_cache_dtype(self) -> str:
        return self.specs[0].kv_cache_dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        """The pool tensors' dtype (the model's, or ``torch.int8``)."""
        return self.specs[0].cache_dtype

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_token(self.specs) * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks


DEFAULT_TOKENS_PER_SEQ = 512  # the default pool holds max_num_seqs sequences of this many tokens


def decide_num_blocks(
    specs: list[LayerKVSpec],
    block_size: int,
    device: torch.device,
    num_blocks: int | None,
    kv_cache_memory: int | None,
    memory_fraction: float,
    max_num_seqs: int,
    max_model_len: int,
) -> int:
    """Blocks for the pool: ``num_blocks`` if given, else from a byte budget, else sized to the workload.

    The default holds ``max_num_seqs`` sequences of ``min(max_model_len, 512)`` tokens, and at least one
    sequence of ``max_model_len`` tokens, but at most ``memory_fraction`` of the free memory. Pool pages are
    committed as blocks are first written, and freed blocks are reused most recently freed first, so the
    resident memory follows the KV in use plus cached prefixes, up to this size.
    """
    per_block = kv_bytes_per_token(specs) * block_size
    if num_blocks is not None:
        return num_blocks
    if kv_cache_memory is not None:
        n = kv_cache_memory // per_block
        if n < 1:
            raise ValueError(
                f"kv_cache_memory={kv_cache_memory} bytes is less than one block ({per_block} bytes)"
            )
        return n
    tokens = max(max_num_seqs * min(max_model_len, DEFAULT_TOKENS_PER_SEQ), max_model_len)
    budget = int(available_memory(device) * memory_fraction)
    return max(1, min(budget // per_block, -(-tokens // block_size)))
