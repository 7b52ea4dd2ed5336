"""Native CPU paged attention for short query lengths (decode, speculative verification).

The gather-then-SDPA torch path reads every cached key and value three times per layer (gather read,
gather write, SDPA read); on a memory-bound decode step that is most of the attention time. The C kernel
in ``csrc/paged_attention_cpu.c`` reads them once, straight from the block pool.

The library is compiled on first use with the host C compiler (``$CC``, else ``cc``/``gcc``) into the
user cache dir, keyed by the source, the flags and the CPU, and loaded with ctypes. The build is
time-limited (``HF_PAGED_CC_TIMEOUT`` seconds, default 120), and each dtype is probed once with a tiny call
checked against the torch path (:mod:`hf_paged.kernels.probes`). Without a working compiler, or when the
probe fails, :func:`available` is False and callers keep the pure-torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from hf_paged.kernels import probes

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.c"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
MAX_Q = 16  # query lengths up to this go through the native kernel
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why = ""  # why the library is missing
PROBE = "attention.native"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _build(cc: str) -> Path:
    from hf_paged.models import cache_dir

    src = SOURCE.read_bytes()
    key = hashlib.sha1(src + " ".join([cc, *CFLAGS, _cpu_key()]).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"paged_attention_cpu-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True,
            timeout=float(os.environ.get("HF_PAGED_CC_TIMEOUT", "120")), stdin=subprocess.DEVNULL,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it once per machine; None if it cannot be built here."""
    global _lib, _tried, _why
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("HF_PAGED_NO_NATIVE") == "1":
            _why = "disabled by HF_PAGED_NO_NATIVE=1"
            return None
        cc = _compiler()
        if cc is None:
            _why = "no C compiler found ($CC, cc, gcc, clang)"
            logger.warning("%s: CPU attention uses the pure-torch path (slower decode)", _why)
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc)))
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            if isinstance(e, subprocess.TimeoutExpired):
                _why = f"building with {cc} timed out after {e.timeout:g} s (HF_PAGED_CC_TIMEOUT)"
            elif isinstance(e, subprocess.CalledProcessError):
                _why = f"building with {cc} failed (exit code {e.returncode}): {_last_line(detail or 'no output')}"
            else:
                _why = f"building with {cc} failed: {_last_line(detail)}"
            logger.warning("building the native CPU attention kernel failed, using the torch path: %s", detail[-2000:])
            return None
        fn = lib.hfp_paged_attention
        fn.restype = ctypes.c_int
        i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, ptr, i64, i64,
                       i32, i32, i32, i32, f32, i32, f32, i32, i32, i32]
        _lib = lib
        return _lib


def _last_line(text: str) -> str:
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "unknown error"


def reset() -> None:
    """Forget the loaded library and probe results, so the next call builds and probes again (for tests)."""
    global _lib, _tried, _why
    with _lock:
        _lib, _tried, _why = None, False, ""
        probes.reset(PROBE)


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the native kernel builds here and computes ``dtype`` correctly (probed once per dtype)."""
    return probes.probe(PROBE, dtype).ok


def unavailable_reason(dtype: torch.dtype = torch.float32) -> str:
    return probes.probe(PROBE, dtype).reason


def _probe(dtype: torch.dtype) -> None:
    """A tiny decode + short-query step (GQA 2:1, two blocks, a sliding window) against the torch path."""
    if dtype not in _DTYPES:
        raise NotImplementedError(f"the native kernel takes {sorted(str(d) for d in _DTYPES)}, not {dtype}")
    if load() is None:
        raise RuntimeError(_why or "the native kernel could not be built")
    from hf_paged.kernels.torch_attention import paged_attention_torch

    g = torch.Generator().manual_seed(0)
    block_size, kvh, heads, dim = 4, 2, 4, 16
    k_cache = torch.randn(6, block_size, kvh, dim, generator=g).to(dtype)
    v_cache = torch.randn(6, block_size, kvh, dim, generator=g).to(dtype)
    block_tables = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([7, 11], dtype=torch.int32)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    query = torch.randn(4, heads, dim, generator=g).to(dtype)
    for window in (None, 5):
        want = paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, cu, 3, 11, 0.25, window)
        out = torch.zeros_like(query)
        paged_attention_native(
            query, k_cache, v_cache, block_tables, seq_lens, cu, torch.tensor([0, 1], dtype=torch.int32), out,
            0.25, window, None, 3,
        )
        probes.check_close(out, want, f"native attention (window {window})")


probes.register(PROBE, _probe)


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in _DTYPES
        and k_cache.dtype == query.dtype
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
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    rc = lib.hfp_paged_attention(
        query.data_ptr(), query.stride(0), query.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), cu_seqlens_q.data_ptr(),
        seq_ids.data_ptr(), seq_ids.numel(),
        out.data_ptr(), out.stride(0), out.stride(1),
        num_heads, num_kv_heads, head_dim, block_size,
        float(scale), int(sliding_window or 0), float(softcap or 0.0), _DTYPES[query.dtype], max_q,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("native CPU attention could not allocate its scratch buffers")
