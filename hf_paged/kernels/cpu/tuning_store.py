"""Kernel timings kept across runs, so a warm start does not time the same kernels again.

Which linear packing is fastest for a weight shape is measured on the host (:func:`packed_linear.fastest_kind`,
about a second per shape on 2 cores). The answer depends on the CPU, the ISA level (``HF_PAGED_ISA``), the
thread count, the library versions and the C sources, not on the model: this store keeps the measured timings in
``<cache dir>/tuning/<fingerprint>.json``, one file per such combination, and the next process with the same
fingerprint reads them instead of timing. ``HF_PAGED_RETUNE=1`` times again (and overwrites);
``HF_PAGED_TUNING_STORE=0`` neither reads nor writes (the test suite's default, so each test process times
afresh). A file that cannot be read or parsed is ignored (one warning) and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

import torch

from hf_paged.kernels.cpu import isa
from hf_paged.env import cache_dir

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded: dict[str, dict] | None = None  # fingerprint -> entries, read once per process


def enabled() -> bool:
    return os.environ.get("HF_PAGED_TUNING_STORE", "1") != "0"


def _fingerprint() -> str:
    from hf_paged.kernels.cpu.native import sources_digest

    parts = [isa.cache_key(), torch.__version__, str(torch.get_num_threads()), _version(), sources_digest()]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def _version() -> str:
    from hf_paged import __version__

    return __version__


def _path() -> Path:
    return cache_dir() / "tuning" / f"{_fingerprint()}.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("ignoring the kernel timings in %s (%s); they are measured again", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def get(key: str) -> dict[str, float] | None:
    """The stored timings (kind -> seconds per call) for ``key`` on this host, or None."""
    global _loaded
    if not enabled() or os.environ.get("HF_PAGED_RETUNE") == "1":
        return None
    with _lock:
        fp = _fingerprint()
        if _loaded is None or fp not in _loaded:
            _loaded = {**(_loaded or {}), fp: _read(_path())}
        value = _loaded[fp].get(key)
    if isinstance(value, dict) and value and all(isinstance(v, (int, float)) and v > 0 for v in value.values()):
        return {str(k): float(v) for k, v in value.items()}
    return None


def put(key: str, timings: dict[str, float]) -> None:
    """Store ``timings`` for ``key`` (atomically: a concurrent reader sees the old file or the new one)."""
    global _loaded
    if not enabled():
        return
    with _lock:
        path = _path()
        entries = {**_read(path), key: timings}
        _loaded = {**(_loaded or {}), _fingerprint(): entries}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("could not store kernel timings in %s: %s", path, e)


def forget() -> None:
    """Drop what this process read (tests; the files stay)."""
    global _loaded
    with _lock:
        _loaded = None
