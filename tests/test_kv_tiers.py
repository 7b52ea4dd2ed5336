"""KV tiers below the pool (docs/kv_tiers.md): the scheduling side block by block, then engines end to end.

Every engine test checks greedy token ids against stock ``generate`` and against an engine without tiers, and
that the tier really served the prefix (its hit counters), so a promotion that copied the wrong bytes fails.
"""

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_paged import SamplingParams
from hf_paged.core.block_pool import hash_block_tokens
from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.kv_tiers import KVTiers
from hf_paged.engine.generator import PagedGenerator
from hf_paged.executor import kv_disk
from tests.helpers import make_model, make_prompts, stock_greedy

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0)


# -- the scheduling side (pure Python) ------------------------------------------------------------------------
class FakeStore:
    """Host slots and files as token tuples: what the tier moves would carry."""

    has_disk = True

    def __init__(self, num_host_slots: int, files: dict | None = None) -> None:
        self.num_host_slots = num_host_slots
        self.files = files if files is not None else {}
        self.slots: dict[int, object] = {}
        self.bad: set = set()  # hashes whose files fail their checks

    def disk_has(self, h):
        return h in self.files

    def load(self, h, slot):
        if h in self.bad:
            self.files.pop(h, None)  # as the real store does: the file is deleted
            return False
        self.slots[slot] = self.files[h]
        return True

    def read_ahead(self, hashes):
        pass

    def drop_disk(self):
        self.has_disk = False

    def counters(self):
        return {}


def run_moves(kv: KVCacheManager, store: FakeStore, pool_tokens: dict, moves) -> None:
    """Apply a step's tier moves to a token model of the pool, in the executor's order."""
    for block, slot in moves.demote:
        store.slots[slot] = pool_tokens.get(block)
    for slot, block in moves.promote:
        pool_tokens[block] = store.slots[slot]


def fill(kv: KVCacheManager, seq_id, tokens: list[int], pool_tokens: dict) -> None:
    """Admit ``tokens`` as a sequence, run the step's tier moves, 'compute' its new tokens (the forward), cache
    its blocks, and free it."""
    cached, hashes = kv.find_cached_prefix(tokens)
    n = len(cached) * BS
    assert kv.allocate_slots(seq_id, n, len(tokens) - n, cached, hashes) is not None
    run_moves(kv, kv.tiers.store, pool_tokens, kv.tiers.take_moves())
    for i, block in enumerate(kv.tables[seq_id]):
        if i * BS >= n:
            pool_tokens[block.block_id] = tuple(tokens[i * BS : (i + 1) * BS])

    class Src:
        num_tokens = len(tokens)

        def token_ids(self, a, b):
            return tokens[a:b]

    kv.cache_blocks(seq_id, Src(), len(tokens))
    kv.free(seq_id)


def test_evicted_cached_blocks_demote_and_come_back_with_their_bytes():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    store = FakeStore(num_host_slots=8)
    kv.tiers = tiers = KVTiers(kv.pool, store)
    pool_tokens: dict = {}
    a = list(range(10, 23))  # 3 full blocks + 1 token
    fill(kv, "a", a, pool_tokens)
    b = list(range(100, 116))  # takes all 4 blocks: evicts a's 3 cached blocks
    fill(kv, "b", b, pool_tokens)
    assert sorted(tiers.host.values()) == [0, 1, 2] and tiers.num_demotions == 3
    assert kv.pool.lookup(hash_block_tokens(None, a[:4])) is None  # gone from the pool ...
    cached, _ = kv.find_cached_prefix(a)  # ... found below it, promoted into fresh pool blocks
    moves = tiers.take_moves()
    assert len(cached) == 3 and tiers.hits == {"host": 3, "disk": 0}
    assert len(moves.promote) == 3
    run_moves(kv, store, pool_tokens, moves)
    for i, block in enumerate(cached):
        assert pool_tokens[block.block_id] == tuple(a[i * BS : (i + 1) * BS])
        assert block.block_hash is not None and block.ref_cnt == 0  # a cached free block, as any pool hit
    kv.check_consistency()


def test_disk_hit_loads_into_a_host_slot_and_a_bad_file_is_a_miss():
    a = list(range(40, 53))
    hashes, parent = [], None
    for i in range(3):
        parent = hash_block_tokens(parent, a[i * BS : (i + 1) * BS])
        hashes.append(parent)
    store = FakeStore(num_host_slots=4, files={h: tuple(a[i * BS : (i + 1) * BS]) for i, h in enumerate(hashes)})
    store.bad.add(hashes[1])
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    kv.tiers = tiers = KVTiers(kv.pool, store)
    cached, _ = kv.find_cached_prefix(a)
    assert len(cached) == 1  # block 1's file fails its checks: the prefix stops there, block 1 is recomputed
    assert tiers.hits["disk"] == 1 and tiers.num_disk_misses == 1
    pool_tokens: dict = {}
    run_moves(kv, store, pool_tokens, tiers.take_moves())
    assert pool_tokens[cached[0].block_id] == tuple(a[:4])
    kv.check_consistency()


def test_a_block_whose_file_failed_is_saved_again_by_the_engine_that_wrote_it():
    """A file this engine wrote once fails its checks later (torn, or under tensor parallelism another rank's
    partner is missing): the lookup misses, and the recomputed block is queued for disk again."""
    from types import SimpleNamespace

    from hf_paged.core.kv_cache_manager import _TokenList

    a = list(range(40, 49))  # 2 full blocks + 1
    store = FakeStore(num_host_slots=4)
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    kv.tiers = tiers = KVTiers(kv.pool, store)

    def compute(seq_id):  # admit a, plan the step's saves, 'write' the files, cache and free its blocks
        cached, hashes = kv.find_cached_prefix(a)
        n = len(cached) * BS
        assert kv.allocate_slots(seq_id, n, len(a) - n, cached, hashes) is not None
        out = SimpleNamespace(scheduled=[SimpleNamespace(seq_id=seq_id, start=n, token_ids=a[n:], num_draft_tokens=0)])
        tiers.plan_saves(kv, out, {seq_id: _TokenList(a)})
        moves = tiers.take_moves()
        for _, h in moves.save:
            store.files[h] = "bytes"
        kv.cache_blocks(seq_id, _TokenList(a), len(a))
        kv.free(seq_id)
        return len(cached), moves.save

    assert compute("a")[1] and len(store.files) == 2
    assert kv.allocate_slots("x", 0, 8 * BS) is not None  # takes the whole pool: a's blocks leave it ...
    tiers.take_moves()
    tiers.host.clear()  # ... and the host tier too: only the files are left
    tiers.free_slots = list(range(store.num_host_slots - 1, -1, -1))
    kv.free("x")
    h1 = hash_block_tokens(hash_block_tokens(None, a[:4]), a[4:8])
    store.bad.add(h1)
    found, saves = compute("b")
    assert found == 1 and tiers.num_disk_misses == 1  # block 1's file fails: a miss, recomputed ...
    assert [h for _, h in saves] == [h1]  # ... and written again, though this process had saved it before


def test_a_promotion_evicted_in_the_same_schedule_is_cancelled():
    kv = KVCacheManager(2, BS, enable_prefix_caching=True)
    store = FakeStore(num_host_slots=4)
    kv.tiers = tiers = KVTiers(kv.pool, store)
    pool_tokens: dict = {}
    a = list(range(10, 19))  # 2 full blocks + 1
    fill(kv, "a", a[:8], pool_tokens)
    fill(kv, "b", list(range(60, 68)), pool_tokens)  # evicts both of a's blocks to the host tier
    cached, _ = kv.find_cached_prefix(a)
    assert len(cached) == 2
    kv.allocate_slots("c", 0, 8)  # takes both pool blocks back before the copies ran
    moves = tiers.take_moves()
    assert moves.promote == []  # cancelled: a copy into blocks "c" now writes would be stale
    assert [slot for _, slot in moves.demote] == [2, 3]  # b's blocks, evicted by the promotions, are kept
    assert len(tiers.host) == 4 and not tiers.free_slots  # a's copies are still in the host tier
    kv.check_consistency()


def test_a_promotion_pins_its_slot_against_the_demotion_it_causes():
    """One host slot: promoting from it evicts a pool block whose demotion must not take that slot (found by
    the block-accounting state machine)."""
    kv = KVCacheManager(2, BS, enable_prefix_caching=True)
    store = FakeStore(num_host_slots=1)
    kv.tiers = tiers = KVTiers(kv.pool, store)
    pool_tokens: dict = {}
    a = list(range(10, 15))
    fill(kv, "a", a[:4], pool_tokens)
    fill(kv, "b", list(range(60, 68)), pool_tokens)  # a's block goes to slot 0
    assert list(tiers.host.values()) == [0]
    cached, _ = kv.find_cached_prefix(a)
    moves = tiers.take_moves()
    assert len(cached) == 1 and moves.demote == [] and moves.promote == [(0, cached[0].block_id)]
    run_moves(kv, store, pool_tokens, moves)
    assert pool_tokens[cached[0].block_id] == tuple(a[:4])
    kv.check_consistency()


# -- engines --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return make_model()


def prompts_with_shared_prefix():
    base = make_prompts(1, [30], seed=1)[0]
    return [base + [3, 4, 5], base + [7, 8]]


def engine(model, **kw):
    kw.setdefault("num_blocks", 12)
    return PagedGenerator(model, block_size=BS, max_model_len=48, **kw)


def ids(e, prompt):
    return e.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def evict_all(e):
    """A prompt that needs most of the pool: every cached prefix leaves the pool."""
    ids(e, make_prompts(1, [40], seed=5)[0])


def test_host_tier_hit_equals_no_cache_and_stock_generate(model):
    first, second = prompts_with_shared_prefix()
    with engine(model, enable_prefix_caching=False) as plain:
        want = ids(plain, second)
    assert want == stock_greedy(model, second, 6)
    with engine(model, kv_offload_gb=0.001) as e:
        assert ids(e, first) == stock_greedy(model, first, 6)
        evict_all(e)
        got = ids(e, second)
        stats = e.stats()
        e.kv_manager.check_consistency()
    assert got == want
    assert stats.kv_tiers["host_hits"] >= 7 and stats.kv_tiers["demotions"] >= 7
    assert stats.prefix_cache_hits >= 28


def test_restart_reads_what_the_first_engine_wrote(model, tmp_path):
    first, second = prompts_with_shared_prefix()
    with engine(model, prefix_cache_dir=str(tmp_path)) as e:
        ids(e, first)
    assert list(tmp_path.glob("*/*/*.kv")), "the first engine wrote no file"
    with engine(model, prefix_cache_dir=str(tmp_path)) as e:
        got = ids(e, second)
        stats = e.stats()
    assert got == stock_greedy(model, second, 6)
    assert stats.kv_tiers["disk_hits"] == 7 and stats.kv_tiers["disk_bytes_read"] > 0
    assert stats.prefix_cache_hits == 28


def test_corrupt_files_are_skipped_and_recomputed(model, tmp_path, caplog):
    first, second = prompts_with_shared_prefix()
    want = stock_greedy(model, second, 6)
    with engine(model, prefix_cache_dir=str(tmp_path)) as e:
        ids(e, first)
    parent, paths = None, []
    for i in range(3):
        parent = hash_block_tokens(parent, first[i * BS : (i + 1) * BS])
        paths.append(next(tmp_path.glob(f"*/*/{parent.hex()}.kv")))
    good = [p.read_bytes() for p in paths]
    corruptions = {
        "flipped payload bit": (2, good[2][:-1] + bytes([good[2][-1] ^ 1])),
        "truncated": (0, good[0][: len(good[0]) // 2]),
        "foreign (another block's file)": (0, good[1]),
        "garbage": (1, b"garbage"),
    }
    for what, (index, data) in corruptions.items():
        paths[index].write_bytes(data)
        caplog.clear()
        with engine(model, prefix_cache_dir=str(tmp_path)) as e, caplog.at_level(logging.WARNING):
            got = ids(e, second)
            tiers = e.stats().kv_tiers
        assert got == want, what
        assert tiers["disk_hits"] == index and tiers["disk_files_skipped"] == 1, (what, tiers)
        assert sum("unusable file" in r.message for r in caplog.records) == 1, what
        assert paths[index].read_bytes() == good[index], f"{what}: the recomputed block was not written again"


def test_a_different_model_does_not_read_the_files(model, tmp_path):
    first, second = prompts_with_shared_prefix()
    with engine(model, prefix_cache_dir=str(tmp_path)) as e:
        ids(e, first)
    other = make_model(seed=1)
    with engine(other, prefix_cache_dir=str(tmp_path)) as e:
        got = ids(e, second)
        assert e.stats().kv_tiers["disk_hits"] == 0
    assert got == stock_greedy(other, second, 6)


def test_changed_weights_drop_the_host_tier_and_turn_the_disk_tier_off(tmp_path):
    first, second = prompts_with_shared_prefix()
    m = make_model(seed=7)
    weight = m.model.layers[0].mlp.down_proj.weight
    saved = weight.detach().clone()
    try:
        with engine(m, kv_offload_gb=0.001, prefix_cache_dir=str(tmp_path)) as e:
            ids(e, first)
            evict_all(e)
            with torch.no_grad():
                weight.add_(0.05)  # a training step
            got = ids(e, second)
            tiers = e.stats().kv_tiers
            assert e.executor.kv_tiers.disk is None
            e.kv_manager.check_consistency()  # every host slot is free or indexed again
        want = stock_greedy(m, second, 6)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert got == want
    assert tiers["host_hits"] == 0 and tiers["disk_hits"] == 0


def test_unwritable_folder_is_a_clear_error_at_start(model, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="prefix_cache_dir=.*a_file/sub.*not a writable folder"):
        engine(model, prefix_cache_dir=str(blocker / "sub"))


def test_disk_full_stops_writing_once_and_serving_goes_on(model, tmp_path, monkeypatch, caplog):
    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_disk.os, "replace", full)
    first, second = prompts_with_shared_prefix()
    with engine(model, prefix_cache_dir=str(tmp_path)) as e, caplog.at_level(logging.WARNING):
        assert ids(e, first) == stock_greedy(model, first, 6)
        assert ids(e, second) == stock_greedy(model, second, 6)
    assert sum("stops writing" in r.message for r in caplog.records) == 1
    assert not list(tmp_path.glob("*/*/*")), "a temporary file was left behind"


def test_disk_cap_deletes_least_recently_used_files(model, tmp_path):
    first, _ = prompts_with_shared_prefix()
    cap_gb = 4 * 2300 / 2**30  # about 4 files of this tiny model
    with engine(model, prefix_cache_dir=str(tmp_path), prefix_cache_disk_gb=cap_gb) as e:
        ids(e, first)
        e.executor.kv_tiers.flush()
        assert e.stats().kv_tiers["disk_files_evicted"] > 0
    size = sum(p.stat().st_size for p in tmp_path.glob("*/*/*.kv"))
    assert 0 < size <= cap_gb * 2**30


def test_int8_kv_pool_through_the_tiers(model, tmp_path):
    first, second = prompts_with_shared_prefix()
    with engine(model, kv_cache_dtype="int8", enable_prefix_caching=False) as plain:
        want = ids(plain, second)
    with engine(model, kv_cache_dtype="int8", kv_offload_gb=0.001, prefix_cache_dir=str(tmp_path)) as e:
        ids(e, first)
        evict_all(e)
        assert ids(e, second) == want  # an int8 pool's bytes are kept as they are: exact
        assert e.stats().kv_tiers["host_hits"] >= 7
    with engine(model, kv_cache_dtype="int8", prefix_cache_dir=str(tmp_path)) as e:
        assert ids(e, second) == want
        assert e.stats().kv_tiers["disk_hits"] == 7


def test_compressed_host_tier_is_opt_in_and_serves_hits(model):
    first, second = prompts_with_shared_prefix()
    with engine(model, kv_offload_gb=0.001, kv_offload_dtype="int8") as e:
        ids(e, first)
        evict_all(e)
        got = ids(e, second)
        assert e.stats().kv_tiers["host_hits"] >= 7
        assert e.executor.kv_tiers.host.caches[0][0].dtype == torch.int8
    assert len(got) == 6  # not bit-exact by design (docs/kv_tiers.md); the tiny random model may differ


@pytest.mark.parametrize("kw, match", [
    (dict(kv_offload_gb=-1), "kv_offload_gb"),
    (dict(kv_offload_gb=float("inf")), "kv_offload_gb"),
    (dict(prefix_cache_disk_gb="1"), "prefix_cache_disk_gb"),
    (dict(kv_offload_dtype="fp8"), "kv_offload_dtype"),
    (dict(kv_offload_gb=1, enable_prefix_caching=False), "enable_prefix_caching"),
])
def test_bad_tier_settings_are_value_errors(kw, match):
    from hf_paged.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)
    with pytest.raises(TypeError, match="prefix_cache_dir"):
        EngineConfig(prefix_cache_dir=os.sep.encode())


def test_server_restart_serves_the_prefix_from_disk_and_counts_it(tmp_path):
    openai = pytest.importorskip("openai")
    from tests.serving_helpers import TINY_NAME, default_tokenizer, scrape, serve, tiny_chat_model

    tok = default_tokenizer()
    model = tiny_chat_model(tok)
    prompt = "A long shared system prompt about tiers of memory, " * 4
    answers, metrics = [], []
    for _ in range(2):  # the second server is a restart on the same folder
        with serve(model, tok, TINY_NAME, num_blocks=64, block_size=BS, prefix_cache_dir=str(tmp_path)) as (url, loop):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            r = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=5, temperature=0)
            answers.append(r.choices[0].text)
            loop.call(lambda e: e.executor.kv_tiers.flush()).result(30)
            metrics.append(scrape(url))
    assert answers[0] == answers[1]
    assert metrics[0]["hf_paged:kv_tier_disk_bytes_written_total"] > 0
    assert metrics[0]["hf_paged:kv_tier_disk_hits_total"] == 0
    assert metrics[1]["hf_paged:kv_tier_disk_hits_total"] > 0
    assert metrics[1]["hf_paged:kv_tier_disk_bytes_read_total"] > 0


def test_another_process_reads_what_this_one_wrote(model, tmp_path):
    first, second = prompts_with_shared_prefix()
    with engine(model, prefix_cache_dir=str(tmp_path)) as e:
        ids(e, first)
    script = textwrap.dedent(f"""
        import json
        from hf_paged import PagedGenerator, SamplingParams
        from tests.helpers import make_model
        with PagedGenerator(make_model(), block_size={BS}, num_blocks=12, max_model_len=48,
                            prefix_cache_dir={str(tmp_path)!r}) as e:
            out = e.generate([{second!r}], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
            print(json.dumps([out[0].outputs[0].token_ids, e.stats().kv_tiers["disk_hits"]]))
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got, disk_hits = json.loads(run.stdout.strip().splitlines()[-1])
    assert disk_hits == 7
    assert got == stock_greedy(model, second, 6)


def test_disk_blocks_are_read_ahead_while_the_request_waits(model, tmp_path, monkeypatch):
    first, second = prompts_with_shared_prefix()
    with engine(model, prefix_cache_dir=str(tmp_path)) as e:
        ids(e, first)
    with engine(model, prefix_cache_dir=str(tmp_path)) as e:
        e.add_request(second, GREEDY)  # the read-ahead starts here, before any step
        e.executor.kv_tiers.disk.wait_reads()

        def no_reads_on_the_step(*a):
            raise AssertionError("a disk read on the step's path")

        monkeypatch.setattr(kv_disk.DiskTier, "read", no_reads_on_the_step)
        done = []
        while e.has_unfinished_requests():
            done += [o for o in e.step() if o.finished]
        tiers = e.stats().kv_tiers
    assert done[0].outputs[0].token_ids == stock_greedy(model, second, 6)
    assert tiers["disk_hits"] == 7 and tiers["disk_blocks_read_ahead"] == 7


def test_replicas_share_the_folder_a_later_one_serves_what_another_computed(tmp_path, monkeypatch):
    """``hf-paged serve --data-parallel-size 2 --prefix-cache-dir D`` gives every replica the same folder; a
    replica started while another runs finds the prefix the other computed (the code a Ray Serve replica runs)."""
    pytest.importorskip("fastapi")
    from hf_paged import cli
    from hf_paged.cli import replicas as cli_replicas
    from hf_paged.serving import replicas as serving_replicas
    from tests.serving_helpers import tiny_chat_loader

    built = []
    monkeypatch.setattr(serving_replicas, "build_application", lambda spec, size, **kw: built.append((spec, size)))
    monkeypatch.setattr(serving_replicas, "run_replicas", lambda app, **kw: None)
    args = cli.build_parser().parse_args(["serve", "--data-parallel-size", "2", "--prefix-cache-dir", str(tmp_path)])
    assert cli_replicas.cmd_serve_replicas(args, "m") == 0
    spec, size = built[0]
    assert size == 2 and spec.engine_config["prefix_cache_dir"] == str(tmp_path)

    spec.loader = tiny_chat_loader
    spec.engine_config.update(block_size=BS, num_blocks=64)
    prompt = make_prompts(1, [30], seed=1)[0]
    loops, got, hits = [], [], []
    try:
        for _ in range(2):  # replica 1 computes the prompt; replica 2 starts later, replica 1 still serving
            loop, _ = spec.build_app()
            loops.append(loop)
            got.append(loop.call(lambda e: ids(e, prompt)).result(60))
            loop.call(lambda e: e.executor.kv_tiers.flush()).result(30)
            hits.append(loop.call(lambda e: e.stats().kv_tiers["disk_hits"]).result(30))
    finally:
        for loop in loops:
            loop.shutdown()
            loop.engine.close()
    assert got[0] == got[1]
    assert hits == [0, 7]
