"""Test setup. TRITON_INTERPRET must be set before triton is imported anywhere."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# Kernel timings are not read from (or written to) the user's cache across runs: each test process times afresh,
# whatever an earlier run on this machine measured (tests/test_tuning_store.py turns the store on for itself).
os.environ.setdefault("HF_PAGED_TUNING_STORE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _speculation_gate_open(request, monkeypatch):
    """The speculation gate (hf_paged/core/spec_gate.py) decides from measured step times, which differ between
    machines and runs: outside the tests marked ``spec_gate`` (its own, driven by given timings) it lets every
    step draft, so a test of drafting sees the same drafts on any machine. Output never depends on it."""
    if "spec_gate" in request.keywords:
        return
    from hf_paged.core.spec_gate import SpecGate

    monkeypatch.setattr(SpecGate, "allows", lambda self, batch: True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
