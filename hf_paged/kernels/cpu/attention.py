"""Native CPU paged attention for short query lengths (decode, speculative verification).

The gather-then-SDPA torch path reads every cached key and value three times per layer (gather read,
gather write, SDPA read); on a memory-bound decode step that is most of the attention time. The C kernel
in ``csrc/paged_attention_cpu.c`` reads them once, straight from the block pool.

The library is built and loaded by :mod:`hf_paged.kernels.cpu.native` (host compiler, cached per machine,
time-limited), and each dtype is probed once (:mod:`hf_paged.kernels.cpu.probes`) with a tiny call checked
against the readable reference (:mod:`hf_paged.kernels.reference`). Without a working compiler, or when the
probe fails, :func:`available` is False and callers keep the pure-torch path.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from hf_paged.kernels.cpu import probes
from hf_paged.kernels.cpu.native import NativeLibrary
from hf_paged.kernels.kv_quant import quantize_rows
from hf_paged.kernels.reference import paged_attention_reference

# query lengths up to this go through the native kernel (decodes, draft verification, short prompts): 16
# sequences of L keys and L queries, 9 heads of 64, Zen 5, native vs per-sequence SDPA: fp32 L=32 0.38 vs
# 0.95 ms, 64 1.4 vs 1.7, 128 5.6 vs 4.9; bf16 64 1.0 vs 2.0, 128 3.8 vs 5.5
MAX_Q = 64
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# pool dtypes the kernel reads: the float ones (the query's own) and int8 rows with their scale (kv_quant.py)
KV_DTYPE_CODES = {**_DTYPES, torch.int8: 3}
PROBE = "attention.native"
_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
LIBRARY = NativeLibrary(
    "paged_attention_cpu.c",
    {"hfp_paged_attention": (_i32, [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i32, _ptr, _i64, _i64,
                                    _i32, _i32, _i32, _i32, _f32, _i32, _f32, _i32, _i32, _i32, _i32]),
     "hfp_store_kv": (_i32, [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64]),
     "hfp_store_kv_int8": (_i32, [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i32, _i32, _i32, _i64])},
    what="the native CPU attention kernel",
)


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it once per machine; None if it cannot be built here."""
    return LIBRARY.load()


def reset() -> None:
    """Forget the loaded library and probe results, so the next call builds and probes again (for tests)."""
    LIBRARY.reset()
    probes.reset(PROBE)


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the native kernel builds here and computes ``dtype`` correctly (probed once per dtype; for
    ``torch.int8``, an int8 pool read by fp32 queries and written by the native store)."""
    return probes.probe(PROBE, dtype).ok


def unavailable_reason(dtype: torch.dtype = torch.float32) -> str:
    return probes.probe(PROBE, dtype).reason


def _probe(dtype: torch.dtype) -> None:
    """A tiny decode + short-query step (GQA 2:1, two blocks, a sliding window) against the reference; for
    int8, fp32, bf16 and fp16 queries over an int8 pool written by both stores (agreeing byte for byte)."""
    if dtype not in KV_DTYPE_CODES:
        raise NotImplementedError(f"the native kernel takes {sorted(str(d) for d in KV_DTYPE_CODES)}, not {dtype}")
    if load() is None:
        raise RuntimeError(LIBRARY.why or "the native kernel could not be built")
    for qdtype in _DTYPES if dtype == torch.int8 else (dtype,):
        g = torch.Generator().manual_seed(0)
        block_size, kvh, heads, dim = 4, 2, 4, 16
        k_cache = torch.randn(6, block_size, kvh, dim, generator=g).to(qdtype)
        v_cache = torch.randn(6, block_size, kvh, dim, generator=g).to(qdtype)
        if dtype == torch.int8:
            k_cache, v_cache = _probe_store_int8(k_cache, v_cache)
        block_tables = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32)
        seq_lens = torch.tensor([7, 11], dtype=torch.int32)
        cu = torch.tensor([0, 1, 4], dtype=torch.int32)
        query = torch.randn(4, heads, dim, generator=g).to(qdtype)
        for window in (None, 5):
            want = paged_attention_reference(query, k_cache, v_cache, block_tables, seq_lens, cu, 3, 11, 0.25, window)
            out = torch.zeros_like(query)
            paged_attention_native(
                query, k_cache, v_cache, block_tables, seq_lens, cu, torch.tensor([0, 1], dtype=torch.int32), out,
                0.25, window, None, 3,
            )
            probes.check_close(out, want, f"native attention ({qdtype} over {dtype}, window {window})")


def _probe_store_int8(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float pool ``k``/``v`` stored into an int8 pool by the native store, checked against the torch one."""
    shape = (*k.shape[:3], k.shape[3] + 4)
    k_cache, v_cache = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    slots = torch.arange(k.shape[0] * k.shape[1])
    _store(LIBRARY.load(), k.flatten(0, 1), v.flatten(0, 1), k_cache, v_cache, slots)
    for got, src in ((k_cache, k), (v_cache, v)):
        if not torch.equal(got, quantize_rows(src)):
            raise RuntimeError("the native int8 store differs from kv_quant.quantize_rows")
    return k_cache, v_cache


probes.register(PROBE, _probe)


def head_dim_of(cache: torch.Tensor) -> int:
    """As ``kv_quant.head_dim_of``: an int8 pool's rows end with their 4-byte scale."""
    return cache.shape[-1] - 4 if cache.dtype == torch.int8 else cache.shape[-1]


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in _DTYPES
        and k_cache.dtype in (query.dtype, torch.int8)
        and query.stride(-1) == 1
        and k_cache.is_contiguous()
    )


def paged_attention_native(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, contiguous
    seq_lens: torch.Tensor,  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_ids: torch.Tensor,  # [n] int32: the sequences to compute (each with q_len <= max_q)
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written at those sequences' rows
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    max_q: int,
) -> None:
    lib = load()
    assert lib is not None, "native CPU attention is not available"
    assert out.dtype == query.dtype and out.stride(-1) == 1
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q), ("seq_ids", seq_ids)):
        assert t.dtype == torch.int32 and t.is_contiguous(), f"{name} must be contiguous int32"
    _attend(lib, query, k_cache, v_cache, _step_args(block_tables, seq_lens, cu_seqlens_q, seq_ids), out, scale,
            sliding_window, softcap, max_q, torch.get_num_threads())


def _step_args(block_tables, seq_lens, cu_seqlens_q, seq_ids) -> tuple:
    """The per-step int32 metadata as the kernel takes it (pointers and sizes; the tensors must outlive it)."""
    return (block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), cu_seqlens_q.data_ptr(),
            seq_ids.data_ptr(), seq_ids.numel())


def _attend(lib, query, k_cache, v_cache, step_args, out, scale, sliding_window, softcap, max_q, threads) -> None:
    """One unchecked ``hfp_paged_attention`` call (the callers check the tensors)."""
    rc = lib.hfp_paged_attention(
        query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), *step_args,
        out.data_ptr(), out.stride(0), out.stride(1), query.shape[1], k_cache.shape[2], query.shape[2],
        k_cache.shape[1], float(scale), int(sliding_window or 0), float(softcap or 0.0), _DTYPES[query.dtype],
        KV_DTYPE_CODES[k_cache.dtype], max_q, threads,
    )
    if rc != 0:
        raise MemoryError("native CPU attention could not allocate its scratch buffers")


def _store(lib, key, value, k_cache, v_cache, slot_mapping) -> None:
    """One unchecked ``hfp_store_kv`` call (the callers check the tensors); raises if a slot is past the pool.
    An int8 pool quantizes each row on the way in (``hfp_store_kv_int8``)."""
    size = key.element_size()
    if k_cache.dtype == torch.int8:
        rc = lib.hfp_store_kv_int8(
            key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            slot_mapping.data_ptr(), slot_mapping.shape[0], key.shape[1], key.shape[2], _DTYPES[key.dtype],
            k_cache.shape[0] * k_cache.shape[1],
        )
    else:
        rc = lib.hfp_store_kv(
            key.data_ptr(), value.data_ptr(), key.stride(0) * size, value.stride(0) * size,
            k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), slot_mapping.shape[0],
            key.shape[1] * key.shape[2] * size, k_cache.shape[0] * k_cache.shape[1],
        )
    if rc != 0:
        raise IndexError(f"slot_mapping has a slot past the pool's {k_cache.shape[0] * k_cache.shape[1]} slots")


def store_kv_native(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> bool:
    """Copy the new keys and values into their slots in one native call; False (nothing written) where the
    call does not apply (no library, another dtype or layout), and the caller stores them with torch."""
    lib = LIBRARY.load()
    quantized = k_cache.dtype == torch.int8 and key.dtype in _DTYPES
    if (
        lib is None or key.device.type != "cpu" or v_cache.dtype != k_cache.dtype or value.dtype != key.dtype
        or (key.dtype != k_cache.dtype and not quantized)
        or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
        or not k_cache.is_contiguous() or not v_cache.is_contiguous() or v_cache.shape != k_cache.shape
        or key.shape[1:] != (k_cache.shape[2], head_dim_of(k_cache)) or key.shape[1:] != value.shape[1:]
        or key.shape[0] != slot_mapping.shape[0] or value.shape[0] != slot_mapping.shape[0]
        or key.stride(2) != 1 or key.stride(1) != key.shape[2] or value.stride(2) != 1 or value.stride(1) != value.shape[2]
    ):
        return False
    _store(lib, key, value, k_cache, v_cache, slot_mapping)
    return True


class NativeStepArgs(NamedTuple):
    """A native step's per-step kernel arguments, as the native decode program passes them to its recorded
    calls: addresses (valid while the step's :class:`NativeStep` lives) and sizes."""

    slot_mapping: int  # address of the int64 slots [num_tokens]
    step: tuple  # (block tables, their row stride, seq_lens, cu_seqlens_q, seq ids, how many): hfp_paged_attention's
    max_q: int  # the longest query of the step


class NativeStep:
    """The store and attention calls of a step whose every sequence goes through the native kernel (decodes,
    speculative verification; no prefill chunk). The step's arguments are converted once, here; each layer
    then checks only its own tensors and makes the two C calls (the general path, ``store_kv_cpu`` then
    ``paged_attention``, spends ~10 us of Python a layer on checks and dispatch)."""

    def __init__(self, lib: ctypes.CDLL, plan, slot_mapping: torch.Tensor, kv_caches) -> None:
        self.lib = lib
        self.kv_caches = kv_caches
        self.slot_mapping = slot_mapping
        self.num_tokens = slot_mapping.shape[0]
        self.plan = plan  # keeps the int32 tensors below alive
        self.step_args = _step_args(plan.block_tables_i32, plan.seq_lens_i32, plan.cu_seqlens_q_i32, plan.native_seq_ids)
        self.max_q = plan.native_max_q
        self.threads = torch.get_num_threads()

    @classmethod
    def build(cls, plan, slot_mapping: torch.Tensor, kv_caches) -> NativeStep | None:
        """The fast path for this step, or None where some sequence needs the torch path."""
        if plan is None or plan.native_seq_ids is None or plan.groups:
            return None
        lib = LIBRARY.load()
        if lib is None or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous() or slot_mapping.device.type != "cpu":
            return None
        return cls(lib, plan, slot_mapping, kv_caches)

    def kernel_args(self) -> NativeStepArgs:
        """This step's arguments for the native store and attention kernels (the native decode program's)."""
        return NativeStepArgs(self.slot_mapping.data_ptr(), self.step_args, self.max_q)

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        sliding_window: int | None, softcap: float | None,
    ) -> torch.Tensor | None:
        """Store ``k``/``v`` ``[T, KVH, D]`` and attend ``q`` ``[T, H, D]``; None (nothing done) where the
        tensors do not fit the kernel, and the caller takes the general path."""
        k_cache, v_cache = self.kv_caches[layer_idx]
        dt = q.dtype
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            return None
        T, H, D = q.shape
        kvh = k_cache.shape[2]
        if (
            k_cache.dtype not in (dt, torch.int8) or k.dtype is not dt or v.dtype is not dt or dt not in _DTYPES
            or T != self.num_tokens or q.stride(2) != 1 or D != head_dim_of(k_cache) or H % kvh or k.shape != (T, kvh, D) or v.shape != (T, kvh, D)
            or k.stride(2) != 1 or k.stride(1) != D or v.stride(2) != 1 or v.stride(1) != D
        ):
            return None
        _store(self.lib, k, v, k_cache, v_cache, self.slot_mapping)
        out = q.new_empty(T, H, D)
        _attend(self.lib, q, k_cache, v_cache, self.step_args, out, scale, sliding_window, softcap, self.max_q, self.threads)
        return out
