"""Process-wide settings read from the environment, importable from every layer (it imports nothing of ours).

The ``hf-paged env`` report lives in :mod:`hf_paged.cli.env_report`.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """hf_paged's cache folder: ``$HF_PAGED_CACHE``, else ``~/.cache/hf_paged`` (the converted default model,
    built C kernels, inductor artifacts)."""
    root = os.environ.get("HF_PAGED_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_paged")
    return Path(root)
