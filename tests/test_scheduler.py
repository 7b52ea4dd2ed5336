"""Scheduling layer: exact block ids, ref counts, queue order; no torch involved."""

import ast
import random
import sys

import pytest

from hf_paged.core.block_pool import BlockPool
from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.scheduler import Scheduler
from hf_paged.sampling_params import SamplingParams
from hf_paged.sequence import Request, RequestStatus


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, **kw) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return Request(rid, list(range(1, prompt_len + 1)), params, eos_token_ids=frozenset({0}))


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, chunked=True):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len, chunked)


def run_step(sched: Scheduler, token: int = 7):
    """One schedule+update with a fixed sampled token, as the engine would do."""
    out = sched.schedule()
    sampled = {s.request_id: [token] for s in out.scheduled if s.sample}
    sched.update(out, sampled)
    sched.check_consistency()
    return out


def test_scheduling_layer_does_not_import_torch():
    names = ("hf_paged.core.scheduler", "hf_paged.core.block_pool", "hf_paged.core.kv_cache_manager",
             "hf_paged.sequence", "hf_paged.sampling_params")
    for name in names:
        tree = ast.parse(open(sys.modules[name].__file__).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            else:
                continue
            for mod in mods:
                assert mod.split(".")[0] in {"hf_paged", "__future__", "collections", "dataclasses", "enum", "time"}, (
                    f"{name} imports {mod}")
                assert not mod.startswith("hf_paged") or mod in names or mod == "hf_paged.core.kv_cache_manager", mod


def test_block_pool_fifo_and_ref_cnt():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [0, 1] and [b.ref_cnt for b in a] == [1, 1]
    pool.incref(a[:1])
    assert a[0].ref_cnt == 2
    pool.free_blocks(a)
    assert a[0].ref_cnt == 1 and a[1].ref_cnt == 0
    assert pool.free_block_ids() == [2, 3, 1]
    pool.free_blocks(a[:1])
    assert pool.free_block_ids() == [2, 3, 1, 0]
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks(a[:1])
    pool.check_consistency()


def test_allocate_slots_exact_ids_and_none_when_full():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    r1, r2 = make_request("a", 6), make_request("b", 9)
    assert kv.allocate_slots(r1, 6) == [0, 1]
    assert kv.allocate_slots(r2, 9) == [2, 3, 4]
    r1.num_computed_tokens = 6
    assert kv.allocate_slots(r1, 2) == []  # still fits in block 1
    r1.num_computed_tokens = 8
    assert not kv.can_allocate(r1, 1)
    assert kv.allocate_slots(r1, 1) is None
    assert kv.get_block_ids("a") == [0, 1]  # unchanged by the failed call
    kv.free(r1)
    assert kv.pool.free_block_ids() == [1, 0]  # tail block first
    assert kv.allocate_slots(r1, 9, num_lookahead_tokens=0) is None  # 9+8 computed = 17 tokens -> 5 blocks
    r1.num_computed_tokens = 0
    assert kv.allocate_slots(r1, 3, num_lookahead_tokens=4) == [1, 0]
    kv.check_consistency()


def test_decode_first_then_fcfs_prefill():
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("a", 3))
    out = run_step(sched)
    assert [(s.request_id, s.start, s.num_new_tokens, s.sample) for s in out.scheduled] == [("a", 0, 3, True)]
    sched.add_request(make_request("b", 12))
    sched.add_request(make_request("c", 2))
    out = run_step(sched)
    # a decodes first; b gets the rest of the budget as a chunk; c waits (budget spent)
    assert [(s.request_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [("a", 1, True), ("b", 9, False)]
    out = run_step(sched)
    assert [(s.request_id, s.start, s.num_new_tokens, s.sample) for s in out.scheduled] == [
        ("a", 4, 1, True), ("b", 9, 3, True), ("c", 0, 2, True)]
    assert sched.kv.get_block_ids("a") == [0, 4]
    assert sched.kv.get_block_ids("b") == [1, 2, 3]
    assert sched.kv.get_block_ids("c") == [5]


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(str(i), 2))
    out = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["0", "1"]
    assert [r.request_id for r in sched.waiting] == ["2"]


def test_no_chunking_waits_for_budget():
    sched = make_scheduler(max_num_batched_tokens=8, chunked=False)
    sched.add_request(make_request("a", 6))
    sched.add_request(make_request("b", 5))
    out = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"]
    with pytest.raises(ValueError, match="chunked prefill is disabled"):
        sched.add_request(make_request("c", 9))


def test_preemption_of_newest_and_exact_resume():
    # 4 blocks of 2 tokens: two requests of 3-token prompts fill 2 blocks each after one decode.
    sched = make_scheduler(num_blocks=4, block_size=2, max_model_len=8)
    a, b = make_request("a", 3, max_tokens=4), make_request("b", 3, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched, token=11)  # prefill both: blocks a=[0,1] b=[2,3]; each has 4 tokens now
    assert sched.kv.get_block_ids("a") == [0, 1] and sched.kv.get_block_ids("b") == [2, 3]
    out = run_step(sched, token=12)  # decode: a and b each write slot 3 (inside their 2nd block)
    assert out.preempted_req_ids == []
    out = run_step(sched, token=13)  # a needs a 3rd block: b (newest) is preempted
    assert out.preempted_req_ids == ["b"]
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    # b's blocks went back tail first (3, then 2); a takes the head of the free queue
    assert sched.kv.get_block_ids("a") == [0, 1, 3]
    assert sched.kv.pool.free_block_ids() == [2]
    assert b.output_token_ids == [11, 12]
    assert list(sched.waiting) == [b]
    while not a.is_finished:
        run_step(sched, token=14)
    assert a.output_token_ids == [11, 12, 13, 14] and a.status is RequestStatus.FINISHED_LENGTH
    # b resumes: its prompt and both generated tokens are prefilled again, then decoding continues
    out = run_step(sched, token=15)
    assert [(s.request_id, s.start, s.num_new_tokens, s.sample) for s in out.scheduled] == [("b", 0, 5, True)]
    assert out.scheduled[0].request.token_ids(0, 5) == [1, 2, 3, 11, 12]
    while not b.is_finished:
        run_step(sched, token=16)
    assert b.output_token_ids == [11, 12, 15, 16]
    assert sched.kv.num_free_blocks == 4


def test_request_that_cannot_fit_is_rejected():
    sched = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="whole pool"):
        sched.add_request(make_request("big", 6, max_tokens=10))
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(max_model_len=8).add_request(make_request("long", 9))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("empty", 0))
    sched.add_request(make_request("ok", 4, max_tokens=5))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", 4, max_tokens=5))
    assert list(sched.requests) == ["ok"]


def test_stop_conditions():
    sched = make_scheduler()
    eos = make_request("eos", 2, max_tokens=5)
    minimum = make_request("min", 2, max_tokens=5, min_tokens=2)
    stop = make_request("stop", 2, max_tokens=5, stop_token_ids=[9], ignore_eos=True)
    for r in (eos, minimum, stop):
        sched.add_request(r)
    out = sched.schedule()
    sched.update(out, {"eos": [0], "min": [0], "stop": [0]})
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.output_token_ids == [0]
    assert not minimum.is_finished and not stop.is_finished  # min_tokens; ignore_eos
    out = sched.schedule()
    sched.update(out, {"min": [0], "stop": [9]})
    assert minimum.status.finish_reason == "stop" and stop.status.finish_reason == "stop"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_max_model_len_stops_with_length():
    sched = make_scheduler(max_model_len=6)
    r = make_request("r", 4, max_tokens=50)
    sched.add_request(r)
    while not r.is_finished:
        run_step(sched)
    assert r.num_tokens == 6 and r.status.finish_reason == "length"


def test_abort_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 3), make_request("b", 3)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    assert sched.abort_request("b") is b and b.status.finish_reason == "abort"
    assert sched.abort_request("a") is a
    assert sched.abort_request("a") is None and sched.abort_request("zzz") is None
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.schedule().finished_req_ids == ["b", "a"]


@pytest.mark.parametrize("seed", range(12))
def test_random_add_abort_step_never_leaks(seed):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=rng.randint(6, 20), block_size=rng.choice([1, 2, 4]),
                           max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 24), max_model_len=40)
    live: list[str] = []
    n = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.25:
            r = make_request(f"r{n}", rng.randint(1, 12), max_tokens=rng.randint(1, 20))
            n += 1
            try:
                sched.add_request(r)
                live.append(r.request_id)
            except ValueError:
                pass
        elif op < 0.35 and live:
            sched.abort_request(rng.choice(live))
        else:
            out = sched.schedule()
            sampled = {s.request_id: [rng.randint(0, 3)] for s in out.scheduled if s.sample}
            sched.update(out, sampled)
        live = [rid for rid in live if rid in sched.requests]
        sched.check_consistency()
    for rid in list(sched.requests):
        sched.abort_request(rid)
    sched.check_consistency()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


def test_every_request_finishes_under_pressure():
    """A pool that fits only one long request at a time still drains the queue (no hang)."""
    sched = make_scheduler(num_blocks=6, block_size=2, max_num_seqs=4, max_num_batched_tokens=5, max_model_len=12)
    reqs = [make_request(str(i), 4, max_tokens=8) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        out = run_step(sched)
        assert out.scheduled, "no progress with requests pending"
    assert all(r.status.finish_reason == "length" and r.num_output_tokens == 8 for r in reqs)
    assert sched.num_preemptions > 0
