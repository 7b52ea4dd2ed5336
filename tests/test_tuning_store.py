"""Kernel timings kept across runs (hf_paged/kernels/cpu/tuning_store.py): a warm start reads them instead of timing."""

import json

import pytest
import torch

from hf_paged.kernels.cpu import packed_linear
from hf_paged.kernels.cpu import tuning_store

SHAPE = (48, 40)  # a shape no other test times


@pytest.fixture
def store(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_PAGED_TUNING_STORE", "1")
    monkeypatch.delenv("HF_PAGED_RETUNE", raising=False)
    packed_linear.reset()
    yield tmp_path
    packed_linear.reset()


def _timed(monkeypatch) -> list:
    calls = []
    real = packed_linear._time_kinds

    def counting(*args, **kwargs):
        calls.append(args[:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(packed_linear, "_time_kinds", counting)
    return calls


def _kinds() -> list[str]:
    return [k for k in packed_linear.CANDIDATES.get(torch.float32, ()) if packed_linear.available(k, torch.float32)]


def test_a_second_process_reads_the_timings_instead_of_timing(store, monkeypatch):
    if not _kinds():
        pytest.skip("no packing works on this host: nothing is timed")
    calls = _timed(monkeypatch)
    first = packed_linear.fastest_kind(torch.float32, *SHAPE)
    assert len(calls) == 1
    files = list((store / "tuning").glob("*.json"))
    assert len(files) == 1
    assert set(next(iter(json.loads(files[0].read_text()).values()))) == {"torch", *_kinds()}
    packed_linear.reset()  # as a new process: nothing in memory
    assert packed_linear.fastest_kind(torch.float32, *SHAPE) == first
    assert len(calls) == 1  # read, not timed
    packed_linear.reset()
    monkeypatch.setenv("HF_PAGED_RETUNE", "1")
    packed_linear.fastest_kind(torch.float32, *SHAPE)
    assert len(calls) == 2  # HF_PAGED_RETUNE times again


def test_stored_timings_decide_and_garbage_is_ignored(store, monkeypatch):
    kinds = _kinds()
    if not kinds:
        pytest.skip("no packing works on this host: nothing is timed")
    calls = _timed(monkeypatch)
    packed_linear.fastest_kind(torch.float32, *SHAPE)
    path = next((store / "tuning").glob("*.json"))
    entries = json.loads(path.read_text())
    key = next(iter(entries))
    entries[key] = {"torch": 1.0, **{k: 1e-9 for k in kinds}}  # the packing made fastest by the stored numbers
    path.write_text(json.dumps(entries))
    packed_linear.reset()
    assert packed_linear.fastest_kind(torch.float32, *SHAPE) != "torch"
    assert len(calls) == 1
    path.write_text("{not json")
    packed_linear.reset()
    packed_linear.fastest_kind(torch.float32, *SHAPE)
    assert len(calls) == 2  # unreadable: timed again, and the file rewritten
    assert key in json.loads(path.read_text())
