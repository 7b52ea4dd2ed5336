"""``PagedCache``: a ``transformers.Cache`` that keeps K/V in blocks, for stock ``model.generate``.

Greedy, sampling and beam search (``num_beams``) run unchanged with ``past_key_values=PagedCache(model)``.
A beam reorder permutes block tables instead of copying K/V; a block shared by several rows is copied only
when one of them writes into it (copy-on-write), which happens to partially filled last blocks only. Rows
that write identical K/V keep sharing their blocks, so the ``num_beams`` (or ``num_return_sequences``)
copies of a prompt that ``generate`` expands before the prefill are stored once.

The bookkeeping is the engine's own block manager (:class:`~hf_paged.core.kv_cache_manager.KVCacheManager`,
each batch row a sequence of it) and the tensors have the engine pool's layout,
``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache
from transformers.generation.utils import GenerationMixin

from hf_paged.core.kv_cache_manager import BlockCopies, cdiv
from hf_paged.model.hf_config import text_config
from hf_paged.core.row_tables import RowTables
from hf_paged.executor.kv_pool import copy_blocks

logger = logging.getLogger(__name__)

# The keyword ``generate`` and the models take a cache under: transformers 5.24 renamed ``past_key_values`` to
# ``cache`` (the old name still works there, with a FutureWarning).
CACHE_KWARG = (
    "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as integers, so equality is bit equality (NaN == NaN, -0.0 != 0.0)."""
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass
class _Step:
    """The tokens being written by the current forward: ``[start, start + num_new)`` of every row."""

    start: int
    num_new: int
    classes: list[list[int]]  # rows writing identical K/V through their first row (see RowTables.append)
    index: dict[torch.device, tuple] = field(default_factory=dict)  # see PagedCache._index


class PagedCache(Cache):
    """K/V in blocks of ``block_size`` tokens, one block table per batch row, shared copy-on-write.

    Usable as the cache of stock ``model.generate`` (``past_key_values=``, or ``cache=`` from transformers 5.24 on:
    :data:`CACHE_KWARG`) for decoder-only models (greedy, sampling,
    beam search, ``num_return_sequences``). Per-layer K/V shapes, dtype and device are taken from each
    layer's first :meth:`update`, so any attention layout (GQA, MLA-style value dims, ``device_map``) works.
    Sliding-window models keep their full cache; HF's mask applies the window.

    Args:
        model: the causal LM the cache serves (decoder-only).
        block_size: tokens per block, a power of two.
        num_blocks: a fixed pool of this many blocks (``torch.empty``, committed as written); a step that
            needs more raises :class:`~hf_paged.core.kv_cache_manager.OutOfBlocksError`.
        max_tokens: alternative to ``num_blocks``: a fixed pool of ``ceil(max_tokens / block_size)`` blocks.
            With neither, the pool starts empty and grows by at least half its size when full.

    Example:
        >>> cache = hf_paged.PagedCache(model, block_size=16)
        >>> out = model.generate(input_ids, **{hf_paged.hf.cache.CACHE_KWARG: cache}, num_beams=4, max_new_tokens=32)
        >>> cache.check_consistency()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_tokens: int | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(
                f"model must be a transformers model (an nn.Module with a config), got {type(model).__name__}"
            )
        if getattr(model.config, "is_encoder_decoder", False):
            raise NotImplementedError(
                f"PagedCache supports decoder-only models; {type(model).__name__} is encoder-decoder"
            )
        _check_int("block_size", block_size, 1)
        if block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        if num_blocks is not None and max_tokens is not None:
            raise ValueError(f"pass num_blocks or max_tokens, not both (got {num_blocks} and {max_tokens})")
        if num_blocks is not None:
            _check_int("num_blocks", num_blocks, 1)
        if max_tokens is not None:
            _check_int("max_tokens", max_tokens, 1)
            num_blocks = cdiv(max_tokens, block_size)
        super().__init__(layers=[])
        self._num_layers = max(1, int(getattr(text_config(model), "num_hidden_layers", 1) or 1))
        self.block_size = block_size
        self.tables = RowTables(block_size, num_blocks)
        # layer_idx -> (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim] like the engine's
        self.kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._layer_lens: dict[int, int] = {}
        self._step: _Step | None = None

    def __repr__(self) -> str:
        return (
            f"PagedCache(rows={self.tables.num_rows}, tokens={self.get_seq_length()}, block_size={self.block_size}, "
            f"blocks used {self.tables.num_used_blocks}/{self.tables.num_blocks})"
        )

    # -- the Cache API used by models and generate --

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one forward's new K/V of layer ``layer_idx`` and return the layer's whole cache.

        Args:
            key_states: ``[batch, num_kv_heads, q_len, head_dim]``, the new tokens of every row.
            value_states: ``[batch, num_kv_heads, q_len, v_head_dim]``.
            layer_idx: the attention layer.

        Returns:
            ``(keys, values)`` of shape ``[batch, num_kv_heads, seq_len, head_dim]`` (``seq_len`` includes the
            new tokens), gathered from the blocks.
        """
        if key_states.dim() != 4 or value_states.shape[:3] != key_states.shape[:3]:
            raise ValueError(
                "expected key/value states of shape [batch, num_kv_heads, q_len, head_dim], "
                f"got {tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        num_rows, _, q_len, _ = key_states.shape
        start = self._layer_lens.get(layer_idx, 0)
        if layer_idx not in self.kv_caches:
            if self.tables.num_tokens > 0 and (self._step is None or self._step.start > 0):
                raise NotImplementedError(f"layer {layer_idx} wrote its first K/V after the first forward")
            self._init_layer(layer_idx, key_states, value_states)
        if self.tables.num_rows and num_rows != self.tables.num_rows:
            raise ValueError(f"the cache holds {self.tables.num_rows} rows, got key states for {num_rows}")
        if start == self.tables.num_tokens:
            self._begin_step(key_states, value_states)
        else:
            step = self._step
            assert step is not None and (start, q_len) == (step.start, step.num_new), (
                f"layer {layer_idx} writes tokens {start}..{start + q_len} during a step writing "
                f"{None if step is None else (step.start, step.start + step.num_new)}"
            )
            self._split_diverged(key_states, value_states)
        self._write(layer_idx, key_states, value_states)
        self._layer_lens[layer_idx] = start + q_len
        return self._gather(layer_idx, start + q_len)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached for ``layer_idx`` (for a layer that stores nothing: tokens every layer holds)."""
        if layer_idx in self._layer_lens:
            return self._layer_lens[layer_idx]
        return min(self._layer_lens.values(), default=0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the full cache plus the query, from position 0 (windows are masked)."""
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: no per-sequence maximum (a fixed pool bounds the tokens of all rows together)."""
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_linear(self) -> list[bool]:
        """No layer holds a linear-attention (recurrent) state. transformers 5.24 asks this before slicing a
        continued prompt down to its uncached tail, and the base class answers from ``layers``, which is empty
        here: all([]) would read as "only linear layers" and the whole prompt would be run again."""
        return [False] * self._num_layers

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return bool(self._layer_lens)

    @property
    def batch_size(self) -> int:
        return self.tables.num_rows if self.tables.num_rows else -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: new row ``i`` continues old row ``beam_idx[i]``. Moves references, copies nothing.

        Args:
            beam_idx: ``[batch * num_beams]`` int64 old row of each new row.
        """
        self._select(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Row ``i`` becomes rows ``i*repeats .. i*repeats + repeats - 1``, all sharing its blocks."""
        _check_int("repeats", repeats, 1)
        self._select([r for r in range(self.tables.num_rows) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (int ``[n]`` or bool ``[batch]``), in that order."""
        self._select(torch.arange(self.tables.num_rows)[torch.as_tensor(indices).cpu()].tolist())

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every row (a negative count, as ``DynamicCache``)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self._layer_lens:
            return
        self._assert_between_steps()
        keep = max(0, self.tables.num_tokens + tokens_to_remove)
        self.tables.crop(keep)
        self._layer_lens = dict.fromkeys(self._layer_lens, keep)

    def reset(self) -> None:
        """Release every row's blocks; the pool tensors stay allocated for the next batch."""
        self.tables.reset()
        self._layer_lens.clear()
        self._step = None

    # -- memory and invariants --

    def block_tables(self) -> list[list[int]]:
        """Block ids of every row, in order."""
        return [self.tables.block_ids(r) for r in range(self.tables.num_rows)]

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block, summed over layers."""
        return sum(k[0].nbytes + v[0].nbytes for k, v in self.kv_caches.values())

    def kv_bytes_used(self) -> int:
        """Bytes of the blocks some row holds now."""
        return self.tables.num_used_blocks * self.bytes_per_block

    def kv_bytes_reserved(self) -> int:
        """Bytes of the pool tensors (every block, free or not)."""
        return sum(k.nbytes + v.nbytes for k, v in self.kv_caches.values())

    def check_consistency(self) -> None:
        """Assert no block leaks or double frees: each block is free or held once per table holding it."""
        self.tables.check_consistency()
        lens = set(self._layer_lens.values())
        assert len(lens) <= 1 and lens <= {self.tables.num_tokens}, (
            f"layer lengths {self._layer_lens} differ from the tables' {self.tables.num_tokens} tokens"
        )
        for layer_idx, (k, _) in self.kv_caches.items():
            assert k.shape[0] >= self.tables.num_blocks, f"layer {layer_idx} pool smaller than the block pool"

    # -- internals --

    def _init_layer(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        n, kvh = self.tables.num_blocks, key_states.shape[1]
        kw = dict(dtype=key_states.dtype, device=key_states.device)
        self.kv_caches[layer_idx] = (
            torch.empty(n, self.block_size, kvh, key_states.shape[3], **kw),
            torch.empty(n, self.block_size, kvh, value_states.shape[3], **kw),
        )

    def _begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """First layer of a forward: decide which rows keep sharing, make room, copy-on-write."""
        self._assert_between_steps()
        if not torch.is_inference_mode_enabled():
            # a pool made under inference_mode (an earlier generate) cannot be written in place outside it
            for layer_idx, (k, v) in self.kv_caches.items():
                if k.is_inference():
                    self.kv_caches[layer_idx] = k.clone(), v.clone()
        if not self.tables.num_rows:
            self.tables.start(key_states.shape[0])
        classes: list[list[int]] = []
        for group in self.tables.same_table_groups():
            classes.extend(self._identical_classes(group, key_states, value_states))
        start = self.tables.num_tokens
        copies = self.tables.append(key_states.shape[2], classes)
        self._step = _Step(start, key_states.shape[2], classes)
        self._apply_copies(copies)

    def _identical_classes(
        self, rows: list[int], key_states: torch.Tensor, value_states: torch.Tensor
    ) -> list[list[int]]:
        """Split ``rows`` into classes of bit-identical new K/V, in row order."""
        if len(rows) == 1:
            return [rows]
        idx = torch.tensor(rows, device=key_states.device)
        kb, vb = _bits(key_states.index_select(0, idx)), _bits(value_states.index_select(0, idx))
        # an integer checksum buckets the rows; equal checksums are confirmed with an exact comparison
        sums = (kb.flatten(1).sum(1, dtype=torch.int64) + 3 * vb.flatten(1).sum(1, dtype=torch.int64)).tolist()
        reps: dict[int, list[int]] = {}
        classes: list[list[int]] = []
        for i, row in enumerate(rows):
            for c in reps.setdefault(sums[i], []):
                j = rows.index(classes[c][0])
                if torch.equal(kb[i], kb[j]) and torch.equal(vb[i], vb[j]):
                    classes[c].append(row)
                    break
            else:
                reps[sums[i]].append(len(classes))
                classes.append([row])
        return classes

    def _split_diverged(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A later layer of the step: rows that shared because they matched so far must still match."""
        step = self._step
        members = [(m, cls[0]) for cls in step.classes for m in cls[1:]]
        if not members:
            return
        dev = key_states.device
        mem = torch.tensor([m for m, _ in members], device=dev)
        rep = torch.tensor([r for _, r in members], device=dev)
        kb, vb = _bits(key_states), _bits(value_states)
        same = (kb[mem] == kb[rep]).flatten(1).all(1) & (vb[mem] == vb[rep]).flatten(1).all(1)
        for (m, _), ok in zip(members, same.tolist()):
            if ok:
                continue
            logger.debug("row %d diverged from its class mid-step; copying its blocks", m)
            for cls in step.classes:
                if m in cls:
                    cls.remove(m)
            step.classes.append([m])
            step.index.clear()
            self._apply_copies(self.tables.fork(m, step.start))

    def _apply_copies(self, copies: BlockCopies) -> None:
        """Grow the layer tensors to the block pool, then copy ``(src, dst)`` blocks in every layer."""
        n = self.tables.num_blocks
        for layer_idx, (k, v) in self.kv_caches.items():
            if k.shape[0] < n:
                k2, v2 = k.new_empty((n, *k.shape[1:])), v.new_empty((n, *v.shape[1:]))
                k2[: k.shape[0]], v2[: v.shape[0]] = k, v
                self.kv_caches[layer_idx] = k2, v2
        copy_blocks(list(self.kv_caches.values()), copies)

    def _index(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """This step's ``(writer_rows | None, write_slots, gather_blocks)``.

        ``write_slots`` ``[writers * q_len]`` index the pool viewed as ``[blocks * block_size, heads, dim]`` in
        the order of ``states[writer_rows].transpose(1, 2).reshape(-1, heads, dim)``; ``gather_blocks``
        ``[rows * table_len]`` index it viewed as ``[blocks, block_size * heads * dim]``.
        """
        step = self._step
        if device not in step.index:
            bs = self.block_size
            writers = [cls[0] for cls in step.classes]
            pos = torch.arange(step.start, step.start + step.num_new)
            tables = torch.tensor([self.tables.block_ids(r) for r in range(self.tables.num_rows)], dtype=torch.int64)
            write_slots = (tables[writers][:, pos // bs] * bs + pos % bs).flatten()
            rows = None if writers == list(range(self.tables.num_rows)) else torch.tensor(writers, device=device)
            step.index[device] = (rows, write_slots.to(device), tables.flatten().to(device))
        return step.index[device]

    def _write(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        k_cache, v_cache = self.kv_caches[layer_idx]
        rows, write_slots, _ = self._index(k_cache.device)
        for states, cache in ((key_states, k_cache), (value_states, v_cache)):
            if rows is not None:
                states = states.index_select(0, rows)
            flat = states.transpose(1, 2).reshape(-1, *cache.shape[2:])  # [writers * q_len, heads, dim]
            cache.view(-1, *cache.shape[2:]).index_copy_(0, write_slots, flat.to(cache.dtype))

    def _gather(self, layer_idx: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One ``index_select`` of whole blocks per tensor, viewed as ``[rows, heads, seq_len, dim]``."""
        k_cache, v_cache = self.kv_caches[layer_idx]
        _, _, gather_blocks = self._index(k_cache.device)
        out = []
        for cache in (k_cache, v_cache):
            n, bs, heads, dim = cache.shape
            g = cache.view(n, -1).index_select(0, gather_blocks)  # [rows * table_len, bs * heads * dim]
            out.append(g.view(self.tables.num_rows, -1, heads, dim)[:, :seq_len].transpose(1, 2))
        return out[0], out[1]

    def _select(self, rows: list[int]) -> None:
        self._assert_between_steps()
        self.tables.select(rows)
        self._step = None

    def _assert_between_steps(self) -> None:
        assert all(n == self.tables.num_tokens for n in self._layer_lens.values()), (
            f"layers are mid-forward: lengths {self._layer_lens}, tables hold {self.tables.num_tokens}"
        )
