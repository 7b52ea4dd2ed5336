"""A hypothesis state machine over the scheduling layer: every block is accounted for after every step.

With KV tiers (some runs), evicted cached blocks are demoted to host slots, lookups promote them (or read them
from a disk of saved blocks) back, and every saved file is checked against the tokens its hash was made from.

A fake runner executes each SchedulerOutput on a model of the KV pool that records which token each slot
holds (swaps, copy-on-write copies and writes included). Some requests speculate: the fake runner proposes
random drafts, accepts a random prefix of them when verifying (the scheduler rolls the rest back), and, as
a draft model would, scribbles into the look-ahead slots behind a sequence. After every operation:
- every device and host block is free or held exactly ``ref_cnt`` times (``check_consistency``);
- every sequence's computed tokens are really in its blocks (device, or host when swapped);
- every cached block holds the tokens its hash was made from, and every hash chain matches the tokens.
"""

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from hf_paged.core.block_pool import hash_block_tokens
from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.kv_tiers import KVTiers
from hf_paged.core.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES, Scheduler
from hf_paged.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from hf_paged.core.sequence import Sequence, SequenceStatus
from hf_paged.sampling_params import SamplingParams

OPS = {"count": 0, "preempt": {"recompute": 0, "swap": 0}, "prefix_hits": 0, "copies": 0, "forks": 0,
       "verified": 0, "rejected": 0, "tier_hits": 0, "demotions": 0}
PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36, 37]]


class TokenTierStore:
    """The KV tiers' store over token ids: host slots and 'files' (saved blocks by hash)."""

    has_disk = True

    def __init__(self, num_host_slots: int) -> None:
        self.num_host_slots = num_host_slots
        self.slots: list = [None] * num_host_slots
        self.files: dict[bytes, list[int]] = {}

    def disk_has(self, block_hash) -> bool:
        return block_hash in self.files

    def load(self, block_hash, slot) -> bool:
        self.slots[slot] = list(self.files[block_hash])
        return True

    def read_ahead(self, block_hashes) -> None:
        assert all(isinstance(h, bytes) for h in block_hashes)  # a real store reads them in the background

    def drop_disk(self) -> None:
        self.has_disk = False

    def counters(self) -> dict:
        return {}


class FakeRunner:
    """Executes scheduler outputs on a pool of token ids instead of tensors."""

    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int, seed: int,
                 store: TokenTierStore | None = None) -> None:
        self.store = store
        self.bs = block_size
        self.dev = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host_blocks)]
        self.rng = random.Random(seed)
        self.tables: dict[int, list[int]] = {}  # kept from the scheduler's diffs, as the model runner keeps them

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for seq_id in out.finished_seq_ids:
            self.tables.pop(seq_id, None)
        for s in out.scheduled:
            table = self.tables.setdefault(s.seq_id, [])
            del table[s.block_ids_from :]
            table.extend(s.new_block_ids)
        moves = out.tier_moves
        for d, slot in moves.demote if moves else ():  # first: before anything writes the pool
            self.store.slots[slot] = list(self.dev[d])
        for d, h in out.swap_out:
            self.host[h] = list(self.dev[d])
        for h, d in out.swap_in:
            self.dev[d] = list(self.host[h])
        for src, dst in out.block_copies:
            self.dev[dst] = list(self.dev[src])
        for slot, d in moves.promote if moves else ():  # after the swaps and copies, before the forward
            self.dev[d] = list(self.store.slots[slot])
        self.forward(out)
        for d, block_hash in moves.save if moves else ():  # after the forward
            self.store.files[block_hash] = list(self.dev[d])
        return self.sample(out)

    def forward(self, out: SchedulerOutput) -> None:
        for s in out.scheduled:
            block_ids = self.tables[s.seq_id]
            for k, token in enumerate(s.token_ids):
                p = s.start + k
                self.dev[block_ids[p // self.bs]][p % self.bs] = token

    def sample(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        for s in out.scheduled:
            block_ids = self.tables[s.seq_id]
            if not s.sample:
                continue
            if s.num_draft_tokens:  # verify: accept a random prefix of the drafts, then one token
                drafts = s.token_ids[-s.num_draft_tokens :]
                accepted = self.rng.randint(0, len(drafts))
                result.sampled_token_ids[s.seq_id] = drafts[:accepted] + [self.token()]
                OPS["verified"] += 1
                OPS["rejected"] += accepted < len(drafts)
            else:
                for seq_id in [s.seq_id, *s.fork_seq_ids]:
                    result.sampled_token_ids[seq_id] = [self.token()]
            if s.propose:
                result.spec_token_ids[s.seq_id] = [self.token() for _ in range(self.rng.randint(0, 3))]
                # a draft model writes its KV behind the sequence while proposing: never anyone else's slots
                for p in range(s.seq_len, len(block_ids) * self.bs):
                    self.dev[block_ids[p // self.bs]][p % self.bs] = -1
        return result

    def token(self) -> int:
        return self.rng.choice([0, 1, 2, 3, 40, 41])


class BlockAccounting(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 16),
        block_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 24),
        host_blocks=st.integers(0, 10),
        caching=st.booleans(),
        chunked=st.booleans(),
        mode=st.sampled_from(PREEMPTION_MODES),
        policy=st.sampled_from(SCHEDULING_POLICIES),
        seed=st.integers(0, 2**16),
        tier_slots=st.sampled_from([0, 0, 1, 3, 8]),
    )
    def setup(self, num_blocks, block_size, max_num_seqs, budget, host_blocks, caching, chunked, mode, policy, seed,
              tier_slots):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, num_host_blocks=host_blocks)
        store = TokenTierStore(tier_slots) if caching and tier_slots else None
        self.made_from: dict[bytes, list[int]] = {}  # every hash ever cached -> its block's tokens
        if store is not None:
            self.kv.tiers = KVTiers(self.kv.pool, store)
            cache_block = self.kv.pool.cache_block

            def recording(block, block_hash, token_ids):
                self.made_from[block_hash] = list(token_ids)
                return cache_block(block, block_hash, token_ids)

            self.kv.pool.cache_block = recording
        self.sched = Scheduler(self.kv, max_num_seqs, budget, 24, chunked, policy, mode)
        self.runner = FakeRunner(num_blocks, host_blocks, block_size, seed, store)
        self.n = 0

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), cut=st.integers(1, 8), tail=st.lists(st.integers(0, 50), max_size=5),
          max_tokens=st.integers(1, 10), n=st.integers(1, 3), priority=st.integers(-2, 2),
          speculate=st.sampled_from([None, 0, 3]))
    def add(self, prefix, cut, tail, max_tokens, n, priority, speculate):
        OPS["count"] += 1
        prompt = PREFIXES[prefix][:cut] + tail
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)
        request = Sequence(f"r{self.n}", prompt, params, eos_token_ids=frozenset({0}), priority=priority)
        if speculate is not None:  # ngram-like (no look-ahead) or draft-model-like (3 look-ahead slots)
            request.spec_key, request.spec_k, request.spec_lookahead = "fake", 3, speculate
        self.n += 1
        try:
            self.sched.add_request(request)
        except ValueError:
            pass  # cannot fit this pool: rejected before any change

    @precondition(lambda self: self.sched.sequences)
    @rule(data=st.data())
    def abort(self, data):
        OPS["count"] += 1
        seq_id = data.draw(st.sampled_from(sorted(self.sched.sequences)))
        request_id = self.sched.sequences[seq_id].request_id
        for s in [r for r in self.sched.sequences.values() if r.request_id == request_id]:
            assert self.sched.abort_request(s.seq_id) is s

    @precondition(lambda self: self.sched.sequences)
    @rule()
    def step(self):
        OPS["count"] += 1
        hits = self.kv.prefix_hits
        out = self.sched.schedule()
        OPS["copies"] += len(out.block_copies)
        for seq_id in out.preempted_seq_ids:
            request = self.sched.sequences[seq_id]
            OPS["preempt"]["swap" if request.status is SequenceStatus.SWAPPED else "recompute"] += 1
        result = self.runner.execute(out)
        for item in out.scheduled:  # the tables rebuilt from diffs are the scheduler's, entry for entry
            assert self.runner.tables[item.seq_id] == self.kv.get_block_ids(item.seq_id), f"table diff of {item.seq_id}"
        self.sched.update(out, result)
        OPS["prefix_hits"] += self.kv.prefix_hits > hits
        if self.kv.tiers is not None:
            OPS["tier_hits"] += sum(self.kv.tiers.hits.values())
            OPS["demotions"] += self.kv.tiers.num_demotions

    @precondition(lambda self: any(r.num_computed_tokens for r in self.sched.running))
    @rule(data=st.data(), drop_parent=st.booleans())
    def fork(self, data, drop_parent):
        """A beam search's move: a running sequence is continued by a fork (and maybe not by itself)."""
        OPS["count"] += 1
        OPS["forks"] += 1
        parent = data.draw(st.sampled_from([r for r in self.sched.running if r.num_computed_tokens]))
        child = self.sched.fork_sequence(parent, parent.index + 100)
        assert self.kv.get_block_ids(child.seq_id) == self.kv.get_block_ids(parent.seq_id)
        if drop_parent:
            self.sched.abort_request(parent.seq_id)

    @invariant()
    def blocks_are_accounted_for(self):
        if not hasattr(self, "sched"):
            return
        self.sched.check_consistency()
        bs = self.kv.block_size
        for request in self.sched.sequences.values():
            table = self.kv.tables.get(request.seq_id) or self.kv.host_tables.get(request.seq_id) or []
            pool = self.runner.dev if request.seq_id in self.kv.tables else self.runner.host
            for p in range(request.num_computed_tokens):
                assert pool[table[p // bs].block_id][p % bs] == request.token_id(p), (request, p)
            hashes = self.kv.hashes.get(request.seq_id, [])
            parent = None
            for i, h in enumerate(hashes):
                parent = hash_block_tokens(parent, request.token_ids(i * bs, (i + 1) * bs))
                assert h == parent, f"{request}: hash {i} does not match its tokens"
        for block in self.kv.pool.cached.values():
            assert self.runner.dev[block.block_id] == list(block.token_ids), f"cached block {block.block_id} content"
        store = self.runner.store
        if store is not None:  # every host slot and every saved file holds the tokens its hash was made from
            for block_hash, slot in self.kv.tiers.host.items():
                assert store.slots[slot] == self.made_from[block_hash], f"host slot {slot} content"
            for block_hash, tokens in store.files.items():
                assert tokens == self.made_from[block_hash], "saved block content"

    def teardown(self):
        if hasattr(self, "sched"):
            for seq_id in list(self.sched.sequences):
                self.sched.abort_request(seq_id)
            self.sched.check_consistency()
            assert self.kv.num_free_blocks == self.kv.num_blocks
            assert self.kv.host_pool.num_free_blocks == self.kv.host_pool.num_blocks


def test_block_accounting_state_machine_runs_10k_operations():
    before = OPS["count"]
    run_state_machine_as_test(
        BlockAccounting,
        settings=settings(max_examples=200, stateful_step_count=80, deadline=None, derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck)),
    )
    assert OPS["count"] - before >= 10_000, OPS
    # the interesting paths really ran
    assert OPS["preempt"]["recompute"] and OPS["preempt"]["swap"] and OPS["prefix_hits"] and OPS["copies"], OPS
    assert OPS["verified"] and OPS["rejected"], OPS
    assert OPS["tier_hits"] and OPS["demotions"], OPS
