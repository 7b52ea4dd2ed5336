"""Scheduling layer: exact block ids, ref counts, queue order; no torch involved."""

import dataclasses
import random
import subprocess
import sys

import pytest

from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.scheduler import Scheduler
from hf_paged.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from hf_paged.core.sequence import Sequence, SequenceStatus
from hf_paged.sampling_params import SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0, first: int = 1, **kw) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return Sequence(rid, list(range(first, first + prompt_len)), params, eos_token_ids=frozenset({0}), priority=priority)


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                   chunked=True, caching=False, host_blocks=0, **kw):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, num_host_blocks=host_blocks)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len, chunked, **kw)


def sample_all(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """What a runner returns: one token per sampled sequence and per sample it forks."""
    result = ModelRunnerOutput()
    for s in out.scheduled:
        if s.sample:
            for seq_id in [s.seq_id, *s.fork_seq_ids]:
                result.sampled_token_ids[seq_id] = [token]
    return result


def run_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """One schedule+update with a fixed sampled token, as the engine would do."""
    out = sched.schedule()
    sched.update(out, sample_all(out, token))
    sched.check_consistency()
    return out


def sched_view(sched, out):
    """(request id, start, new tokens, sample) of each scheduled sequence."""
    rid = {r.seq_id: r.request_id for r in [*sched.sequences.values()]}
    return [(rid.get(s.seq_id, s.seq_id), s.start, s.num_new_tokens, s.sample) for s in out.scheduled]


def blocks(sched, request):
    return sched.kv.get_block_ids(request.seq_id)


def test_scheduling_layer_imports_neither_torch_nor_transformers():
    code = (
        "import sys, hf_paged.core.scheduler, hf_paged.core.kv_cache_manager, hf_paged.core.sequence, "
        "hf_paged.core.scheduler_output; "
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_scheduler_output_is_plain_data():
    sched = make_scheduler(caching=True)
    sched.add_request(make_request("a", 5, n=2))
    out = sched.schedule()

    def walk(value):
        assert not isinstance(value, Sequence), "a live Sequence crossed into the runner"
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name))
        elif isinstance(value, (list, tuple, set, frozenset)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k)
                walk(v)
        else:
            assert isinstance(value, (int, float, str, bool, type(None), SamplingParams)), type(value)

    walk(out)
    assert out.new_sequences[0].prompt_token_ids == [1, 2, 3, 4, 5] and out.scheduled[0].fork_seq_ids == [1]


def test_allocate_slots_exact_ids_and_none_when_full():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.allocate_slots("a", 0, 6) == [0, 1]
    assert kv.allocate_slots("b", 0, 9) == [2, 3, 4]
    assert kv.allocate_slots("a", 6, 2) == []  # still fits in block 1
    assert not kv.can_allocate("a", 8, 1)
    assert kv.allocate_slots("a", 8, 1) is None
    assert kv.get_block_ids("a") == [0, 1]  # unchanged by the failed call
    kv.free("a")
    assert kv.pool.free_block_ids() == [0, 1]  # freed blocks go to the head: reused first
    assert kv.allocate_slots("c", 0, 3, num_lookahead=4) == [0, 1]
    kv.check_consistency()


def test_decode_first_then_fcfs_prefill():
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b, c = make_request("a", 3), make_request("b", 12), make_request("c", 2)
    sched.add_request(a)
    out = run_step(sched)
    assert sched_view(sched, out) == [("a", 0, 3, True)]
    sched.add_request(b)
    sched.add_request(c)
    out = run_step(sched)
    # a decodes first; b gets the rest of the budget as a chunk; c waits (budget spent)
    assert sched_view(sched, out) == [("a", 3, 1, True), ("b", 0, 9, False)]
    out = run_step(sched)
    assert sched_view(sched, out) == [("a", 4, 1, True), ("b", 9, 3, True), ("c", 0, 2, True)]
    assert blocks(sched, a) == [0, 4] and blocks(sched, b) == [1, 2, 3] and blocks(sched, c) == [5]


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(str(i), 2))
    out = run_step(sched)
    assert [x[0] for x in sched_view(sched, out)] == ["0", "1"]
    assert [r.request_id for r in sched.waiting] == ["2"]


def test_no_chunking_waits_for_budget():
    sched = make_scheduler(max_num_batched_tokens=8, chunked=False)
    sched.add_request(make_request("a", 6))
    sched.add_request(make_request("b", 5))
    out = run_step(sched)
    assert [x[0] for x in sched_view(sched, out)] == ["a"]
    with pytest.raises(ValueError, match="chunked prefill is disabled"):
        sched.add_request(make_request("c", 9))


def test_no_chunking_still_resumes_a_preempted_request_longer_than_the_budget():
    """The recompute of prompt + output may exceed max_num_batched_tokens: it must not block the queue."""
    sched = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=4, max_model_len=12, chunked=False)
    a, b = make_request("a", 3, max_tokens=6), make_request("b", 3, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    seen = []
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        out = run_step(sched)
        if out.preempted_seq_ids:
            seen.append((b.num_tokens, out.preempted_seq_ids))
    assert seen and seen[0] == (6, [b.seq_id])  # b holds 6 tokens, more than the 4-token budget
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6


def test_preemption_of_newest_and_exact_resume():
    # 4 blocks of 2 tokens: two requests of 3-token prompts fill 2 blocks each after one decode.
    sched = make_scheduler(num_blocks=4, block_size=2, max_model_len=8)
    a, b = make_request("a", 3, max_tokens=4), make_request("b", 3, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched, token=11)  # prefill both: blocks a=[0,1] b=[2,3]; each has 4 tokens now
    assert blocks(sched, a) == [0, 1] and blocks(sched, b) == [2, 3]
    out = run_step(sched, token=12)  # decode: a and b each write slot 3 (inside their 2nd block)
    assert out.preempted_seq_ids == []
    out = run_step(sched, token=13)  # a needs a 3rd block: b (newest) is preempted
    assert out.preempted_seq_ids == [b.seq_id] and sched.num_preemptions == {"recompute": 1, "swap": 0}
    assert sched_view(sched, out) == [("a", 4, 1, True)]
    assert b.status is SequenceStatus.PREEMPTED and b.num_computed_tokens == 0
    # b's blocks went back tail first (3, then 2) to the head; a takes the head of the free queue
    assert blocks(sched, a) == [0, 1, 2]
    assert sched.kv.pool.free_block_ids() == [3]
    assert b.output_token_ids == [11, 12]
    assert list(sched.waiting) == [b]
    while not a.is_finished:
        run_step(sched, token=14)
    assert a.output_token_ids == [11, 12, 13, 14] and a.status is SequenceStatus.FINISHED_LENGTH
    # b resumes: its prompt and both generated tokens are prefilled again, then decoding continues
    out = run_step(sched, token=15)
    assert sched_view(sched, out) == [("b", 0, 5, True)]
    assert out.scheduled[0].token_ids == [1, 2, 3, 11, 12]
    assert out.new_sequences == []  # the runner kept b's state across the preemption
    while not b.is_finished:
        run_step(sched, token=16)
    assert b.output_token_ids == [11, 12, 15, 16]
    assert sched.kv.num_free_blocks == 4


def test_swap_preemption_copies_blocks_out_and_back():
    sched = make_scheduler(num_blocks=4, block_size=2, max_model_len=8, host_blocks=4, preemption_mode="swap")
    a, b = make_request("a", 3, max_tokens=4), make_request("b", 3, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched, token=11)
    run_step(sched, token=12)
    out = run_step(sched, token=13)
    assert out.preempted_seq_ids == [b.seq_id] and out.swap_out == [(2, 0), (3, 1)]
    assert b.status is SequenceStatus.SWAPPED and b.num_computed_tokens == 4 and sched.swapped == [b]
    assert sched.num_preemptions == {"recompute": 0, "swap": 1}
    while not a.is_finished:
        out = run_step(sched, token=14)
        assert not out.swap_in  # no room while a runs
    out = run_step(sched, token=15)
    assert out.swap_in == [(0, 0), (1, 1)] and sched_view(sched, out) == [("b", 4, 1, True)]
    assert blocks(sched, b) == [0, 1, 2]  # its two blocks back, plus one for the new token
    while not b.is_finished:
        run_step(sched, token=16)
    assert b.output_token_ids == [11, 12, 15, 16] and sched.kv.num_free_blocks == 4


def test_auto_preemption_swaps_samples_of_a_group_and_recomputes_singles():
    sched = make_scheduler(num_blocks=8, block_size=2, max_model_len=12, host_blocks=8, preemption_mode="auto")
    group = make_request("g", 3, max_tokens=8, n=2)
    single = make_request("s", 3, max_tokens=8)
    sched.add_request(group)
    sched.add_request(single)
    modes: dict[str, set] = {"g": set(), "s": set()}
    for _ in range(60):
        if not sched.has_unfinished_requests():
            break
        out = run_step(sched)
        for seq_id in out.preempted_seq_ids:
            victim = sched.sequences[seq_id]
            modes[victim.request_id].add(victim.status)
    assert modes["g"] <= {SequenceStatus.SWAPPED} and modes["s"] <= {SequenceStatus.PREEMPTED}
    assert modes["g"] or modes["s"]  # the pool really ran out
    assert sched.kv.num_free_blocks == 8


def test_request_that_cannot_fit_is_rejected():
    sched = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="whole pool"):
        sched.add_request(make_request("big", 6, max_tokens=10))
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(max_model_len=8).add_request(make_request("long", 9))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("empty", 0))
    ok = make_request("ok", 4, max_tokens=5)
    sched.add_request(ok)
    assert list(sched.sequences) == [ok.seq_id]


def test_stop_conditions():
    sched = make_scheduler()
    eos = make_request("eos", 2, max_tokens=5)
    minimum = make_request("min", 2, max_tokens=5, min_tokens=2)
    stop = make_request("stop", 2, max_tokens=5, stop_token_ids=[9], ignore_eos=True)
    for r in (eos, minimum, stop):
        sched.add_request(r)
    out = sched.schedule()
    sched.update(out, ModelRunnerOutput({eos.seq_id: [0], minimum.seq_id: [0], stop.seq_id: [0]}))
    assert eos.status is SequenceStatus.FINISHED_STOPPED and eos.output_token_ids == [0]
    assert not minimum.is_finished and not stop.is_finished  # min_tokens; ignore_eos
    out = sched.schedule()
    sched.update(out, ModelRunnerOutput({minimum.seq_id: [0], stop.seq_id: [9]}))
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
    assert sched.abort_request(b.seq_id) is b and b.status.finish_reason == "abort"
    assert sched.abort_request(a.seq_id) is a
    assert sched.abort_request(a.seq_id) is None and sched.abort_request(999) is None
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.schedule().finished_seq_ids == [a.seq_id]  # b never reached the runner


@pytest.mark.parametrize("seed", range(12))
def test_random_add_abort_step_never_leaks(seed):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=rng.randint(6, 20), block_size=rng.choice([1, 2, 4]),
                           max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 24), max_model_len=40)
    live: list[int] = []
    n = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.25:
            r = make_request(f"r{n}", rng.randint(1, 12), max_tokens=rng.randint(1, 20))
            n += 1
            try:
                sched.add_request(r)
                live.append(r.seq_id)
            except ValueError:
                pass
        elif op < 0.35 and live:
            sched.abort_request(rng.choice(live))
        else:
            out = sched.schedule()
            sched.update(out, sample_all(out, rng.randint(0, 3)))
        live = [sid for sid in live if sid in sched.sequences]
        sched.check_consistency()
    for rid in list(sched.sequences):
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
    assert sum(sched.num_preemptions.values()) > 0


def test_priority_policy_admits_and_preempts_by_priority_then_arrival():
    sched = make_scheduler(num_blocks=6, block_size=2, max_num_seqs=2, max_model_len=12, scheduling_policy="priority")
    low, high, mid = make_request("low", 3, priority=5), make_request("high", 3, priority=-1), make_request("mid", 3, priority=1)
    for r in (low, high, mid):
        sched.add_request(r)
    out = run_step(sched)
    assert [x[0] for x in sched_view(sched, out)] == ["high", "mid"]  # low waits despite arriving first
    assert [r.request_id for r in sched.running] == ["high", "mid"]
    victims = []
    for _ in range(40):
        running = {r.seq_id: r.priority for r in sched.running}
        out = run_step(sched)
        for seq_id in out.preempted_seq_ids:  # always the lowest priority of those running
            victims.append(seq_id)
            assert running[seq_id] == max(running.values())
    assert victims and high.seq_id not in victims
    assert high.is_finished and mid.is_finished and low.is_finished


def test_n_samples_prefill_once_then_fork_and_share_blocks():
    sched = make_scheduler(block_size=4, caching=True)
    r = make_request("r", 6, max_tokens=4, n=3)
    sched.add_request(r)
    out = sched.schedule()
    assert sched_view(sched, out) == [("r", 0, 6, True)] and out.scheduled[0].fork_seq_ids == [1, 2]
    result = ModelRunnerOutput({r.seq_id: [10], 1: [11], 2: [12]})
    changed = sched.update(out, result)
    assert sorted((c.index, c.output_token_ids) for c in changed) == [(0, [10]), (1, [11]), (2, [12])]
    kids = [sched.sequences[1], sched.sequences[2]]
    assert all(k.request_id == "r" and blocks(sched, k) == [0, 1] for k in kids)
    assert [b.ref_cnt for b in sched.kv.pool.blocks[:2]] == [3, 3]
    out = sched.schedule()  # each sample writes token 6 into the shared partial block 1: two copies
    assert sorted(out.block_copies) == [(1, 2), (1, 3)]
    assert {tuple(sched.kv.get_block_ids(s.seq_id)) for s in out.scheduled} == {(0, 2), (0, 3), (0, 1)}
    # tables go to the runner as diffs: the forks' whole tables (new to it), the parent's changed tail only
    for s in out.scheduled:
        assert sched.kv.get_block_ids(s.seq_id)[s.block_ids_from :] == s.new_block_ids
    assert sorted(s.block_ids_from for s in out.scheduled) == [0, 0, 1]
    assert [b.ref_cnt for b in sched.kv.pool.blocks[:4]] == [3, 1, 1, 1]
    sched.check_consistency()


def test_admission_starts_after_the_cached_prefix():
    sched = make_scheduler(block_size=4, caching=True)
    a = make_request("a", 10, max_tokens=2)
    sched.add_request(a)
    while not a.is_finished:
        run_step(sched)
    b = make_request("b", 13, max_tokens=2)  # shares a's first 10 tokens: 2 full blocks cached
    sched.add_request(b)
    out = run_step(sched)
    assert sched_view(sched, out) == [("b", 8, 5, True)] and b.num_cached_tokens == 8
    assert sched.kv.prefix_queries == 23 and sched.kv.prefix_hits == 8


def test_long_prefill_token_threshold_chunks_an_arriving_prompt_while_others_decode():
    # budget 64, cap 10: a 30-token prompt alone runs whole; one arriving while "a" decodes gets 10 a step
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=64, long_prefill_token_threshold=10)
    sched.add_request(make_request("alone", 30, max_tokens=2))
    assert sched_view(sched, run_step(sched)) == [("alone", 0, 30, True)]
    run_step(sched)  # its last token: it finishes
    a = make_request("a", 4, max_tokens=20)
    sched.add_request(a)
    assert sched_view(sched, run_step(sched)) == [("a", 0, 4, True)]
    sched.add_request(make_request("b", 25, max_tokens=4, first=40))
    outs = [run_step(sched) for _ in range(4)]
    assert [sched_view(sched, o) for o in outs] == [
        [("a", 4, 1, True), ("b", 0, 10, False)],
        [("a", 5, 1, True), ("b", 10, 10, False)],
        [("a", 6, 1, True), ("b", 20, 5, True)],
        [("a", 7, 1, True), ("b", 25, 1, True)],
    ]
    assert [o.num_batched_tokens for o in outs] == [11, 11, 6, 2]


def test_long_prefill_token_threshold_off_and_its_checks():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=64, long_prefill_token_threshold=None)
    sched.add_request(make_request("a", 4, max_tokens=20))
    run_step(sched)
    sched.add_request(make_request("b", 25, first=40))
    assert sched_view(sched, run_step(sched)) == [("a", 4, 1, True), ("b", 0, 25, True)]
    assert make_scheduler(long_prefill_token_threshold=0).long_prefill_token_threshold == 0
    with pytest.raises(ValueError, match="long_prefill_token_threshold.*-5"):
        make_scheduler(long_prefill_token_threshold=-5)
    with pytest.raises(TypeError, match="long_prefill_token_threshold.*'256'"):
        make_scheduler(long_prefill_token_threshold="256")
    with pytest.raises(TypeError, match="long_prefill_token_threshold.*True"):
        make_scheduler(long_prefill_token_threshold=True)


def test_engine_config_checks_long_prefill_token_threshold():
    from hf_paged.config import EngineConfig

    assert EngineConfig().long_prefill_token_threshold == 256
    assert EngineConfig(long_prefill_token_threshold=None).long_prefill_token_threshold is None
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be a positive int.*got -1"):
        EngineConfig(long_prefill_token_threshold=-1)
    with pytest.raises(TypeError, match="long_prefill_token_threshold must be a positive int.*got 1.5"):
        EngineConfig(long_prefill_token_threshold=1.5)
