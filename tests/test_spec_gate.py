"""The speculation gate: speculation where the engine's measured steps say it pays (pure Python, no torch)."""

import pytest

from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.scheduler import Scheduler
from hf_paged.core.scheduler_output import ModelRunnerOutput
from hf_paged.core.sequence import Sequence
from hf_paged.core.spec_gate import SpecGate
from hf_paged.sampling_params import SamplingParams

pytestmark = pytest.mark.spec_gate


def test_buckets_are_powers_of_two():
    assert [SpecGate.bucket_of(b) for b in (1, 2, 3, 4, 7, 8, 64, 65)] == [1, 2, 2, 3, 3, 4, 7, 7]


def feed(gate, batch, steps, spec_rate, plain_rate):
    """Run ``steps`` decisions at ``batch``, each followed by a step of the kind decided at the given rate;
    returns the decisions."""
    decisions = []
    for _ in range(steps):
        allowed = gate.allows(batch)
        decisions.append(allowed)
        rate = spec_rate if allowed else plain_rate
        gate.observe(batch / rate, batch, batch, allowed)  # tokens = batch, in batch / rate seconds
    return decisions


def test_measures_both_kinds_then_keeps_the_faster_and_reprobes_the_loser():
    gate = SpecGate(min_samples=3, reprobe=16)
    decisions = feed(gate, 64, 40, spec_rate=180.0, plain_rate=290.0)  # speculation costs at 64
    assert decisions[:3] == [True] * 3 and decisions[3:6] == [False] * 3  # measured both ways first
    tail = decisions[6:]
    assert tail.count(True) <= 6 and tail.count(False) >= 28  # plain from then on, short speculative re-probes
    assert any(tail)  # ... which do happen
    assert gate.num_stopped == decisions.count(False)

    gate = SpecGate(min_samples=3, reprobe=16)
    decisions = feed(gate, 4, 40, spec_rate=60.0, plain_rate=35.0)  # speculation pays at 4
    assert decisions[6:].count(True) >= 28


def test_batch_one_always_speculates_and_buckets_are_independent():
    gate = SpecGate(min_samples=2, reprobe=8)
    feed(gate, 64, 20, spec_rate=100.0, plain_rate=300.0)
    assert all(gate.allows(1) for _ in range(10))
    assert gate.allows(8)  # a bucket of its own, not yet measured: speculation first
    summary = gate.summary()
    assert summary["64-127"]["plain_tok_s"] == pytest.approx(300.0) and summary["64-127"]["spec_tok_s"] == pytest.approx(100.0)


def test_unmeasured_buckets_follow_a_neighbour_that_settles_them():
    gate = SpecGate(min_samples=2, reprobe=64)
    feed(gate, 16, 6, spec_rate=100.0, plain_rate=300.0)  # costs at 16-31
    assert feed(gate, 64, 10, spec_rate=50.0, plain_rate=300.0) == [False] * 10  # so at 64: no losing probe
    assert feed(gate, 4, 4, spec_rate=90.0, plain_rate=60.0) == [True, True, False, False]  # smaller: measured
    assert feed(gate, 2, 6, spec_rate=50.0, plain_rate=40.0) == [True] * 6  # it pays at 4-7: so at 2-3
    assert gate.bucket_of(8) not in gate.buckets or not gate.buckets[gate.bucket_of(8)].spec_steps
    assert feed(gate, 8, 4, spec_rate=70.0, plain_rate=60.0) == [True, True, False, False]  # between: measured


def test_a_change_in_acceptance_is_noticed_by_the_reprobes():
    gate = SpecGate(min_samples=2, reprobe=8, weight=0.5)
    decisions = feed(gate, 16, 24, spec_rate=100.0, plain_rate=200.0)
    assert decisions[-8:].count(False) >= 6  # plain wins
    decisions = feed(gate, 16, 48, spec_rate=400.0, plain_rate=200.0)  # the text turned predictable
    assert decisions[-16:].count(True) >= 12


def test_gate_ignores_what_it_cannot_compare():
    gate = SpecGate()
    for seconds, rows, tokens in ((0.0, 4, 4), (float("inf"), 4, 4), (0.1, 1, 1), (0.1, 4, 0)):
        gate.observe(seconds, rows, tokens, True)
    assert gate.buckets == {}


@pytest.mark.parametrize("kw", [dict(min_samples=0), dict(reprobe=2, min_samples=3), dict(weight=0.0),
                                dict(min_samples=True)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match="SpecGate"):
        SpecGate(**kw)


def _spec_request(i, limit):
    r = Sequence(f"r{i}", list(range(1, 9)), SamplingParams(max_tokens=60, temperature=0.0),
                 eos_token_ids=frozenset({0}))
    r.spec_key, r.spec_k, r.spec_disable_batch_size = "ngram:1:4", 2, limit
    return r


def _run(sched, seconds_of, steps):
    """Engine-like steps: every proposing sequence gets 2 drafts, verification accepts none; the step's
    seconds come from ``seconds_of(out)``. Returns the number of steps that verified drafts."""
    spec_steps = 0
    for _ in range(steps):
        out = sched.schedule()
        result = ModelRunnerOutput()
        for s in out.scheduled:
            if s.sample:
                result.sampled_token_ids[s.seq_id] = [7]
                if s.propose:
                    result.spec_token_ids[s.seq_id] = [7, 7]
        spec_steps += any(s.num_draft_tokens for s in out.scheduled)
        sched.observe_step(out, seconds_of(out), result)
        sched.update(out, result)
        sched.check_consistency()
    return spec_steps


@pytest.mark.parametrize("limit, stops", [("auto", True), (None, False)])
def test_scheduler_stops_drafting_where_measured_steps_say_it_costs(limit, stops):
    kv = KVCacheManager(200, 4)
    sched = Scheduler(kv, 8, 256, 128)
    for i in range(8):
        sched.add_request(_spec_request(i, limit))
    # a verifying step costs 3x a plain one and accepts nothing: speculation loses at batch 8
    spec_steps = _run(sched, lambda out: 0.03 if any(s.num_draft_tokens for s in out.scheduled) else 0.01, 40)
    if stops:
        assert 1 <= spec_steps <= 3  # the first measurements, not the other ~37 steps
        assert sched.spec_gate.summary()["8-15"]["plain_steps"] >= 20
    else:
        assert spec_steps >= 35  # None: speculation at any batch size (vLLM's default), the gate is not used
        assert sched.spec_gate.buckets == {}


def test_steps_between_the_two_kinds_are_not_measured():
    """A step's time includes drafting for the next step: the plain step that starts drafting (slow here) and the
    verifying step that stops are left out, so plain decoding, slightly faster, still wins."""
    kv = KVCacheManager(200, 4)
    sched = Scheduler(kv, 8, 256, 128)
    for i in range(8):
        sched.add_request(_spec_request(i, "auto"))

    def seconds(out):
        verified = any(s.num_draft_tokens for s in out.scheduled)
        drafts = any(s.propose for s in out.scheduled)
        return {(True, True): 0.012, (False, False): 0.010, (False, True): 0.05, (True, False): 0.012}[verified, drafts]

    spec_steps = _run(sched, seconds, 40)
    summary = sched.spec_gate.summary()["8-15"]
    assert summary["plain_tok_s"] == pytest.approx(800.0) and summary["spec_tok_s"] == pytest.approx(8 / 0.012, abs=0.1)
    assert spec_steps <= 3
