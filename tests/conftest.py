"""Test setup. TRITON_INTERPRET must be set before triton is imported anywhere."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# Kernel timings are not read from (or written to) the user's cache across runs: each test process times afresh,
# whatever an earlier run on this machine measured (tests/test_tuning_store.py turns the store on for itself).
os.environ.setdefault("HF_PAGED_TUNING_STORE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
