"""The disk tier of the KV tiers under tensor parallelism (gloo, 2 processes on loopback, docs/kv_tiers.md): each
rank writes and reads its own shard's files; a block is served from disk only when every rank has a good file.

Every tensor-parallel engine spawns one worker (several seconds each): the cases share engines where they can."""

from __future__ import annotations

import torch

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.core.block_pool import hash_block_tokens
from hf_paged.executor.kv_tiers_tp import DiskLoad, load_and_agree, serve_tier_message
from tests.helpers import make_model, make_prompts
from tests.test_tensor_parallel import no_process_left  # noqa: F401 - autouse: no worker left behind

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(num_blocks=24, block_size=BS, max_model_len=48)


def ids(engine, prompt):
    return engine.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def prefix_pair(seed: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing 30 tokens: the second's lookup covers 7 full blocks of the first's."""
    shared = make_prompts(1, [30], seed=seed)[0]
    return shared + [3, 4, 5], shared + [7, 8]


def block_name(prompt: list[int], index: int) -> str:
    """A block's file name under a rank's folder (``<2 hex>/<hash>.kv``)."""
    parent = None
    for i in range(index + 1):
        parent = hash_block_tokens(parent, prompt[i * BS : (i + 1) * BS])
    return f"{parent.hex()[:2]}/{parent.hex()}.kv"


def tiers(engine) -> dict:
    return dict(engine.stats().kv_tiers)


def test_each_rank_its_own_files_a_restart_reads_them_and_one_bad_file_makes_every_rank_recompute(tmp_path):
    model = make_model("llama")  # 2 KV heads: each rank's files hold its one head
    pairs = {name: prefix_pair(seed) for name, seed in (("a", 1), ("b", 2), ("c", 3))}
    with PagedGenerator(model, enable_prefix_caching=False, **ENGINE) as plain:
        want = {name: [ids(plain, p) for p in pair] for name, pair in pairs.items()}
    tp = dict(tensor_parallel_size=2, prefix_cache_dir=str(tmp_path), **ENGINE)

    engine = PagedGenerator(model, **tp)
    try:
        got = {name: ids(engine, pair[0]) for name, pair in pairs.items()}
        engine.executor.kv_tiers.flush()  # every rank's writer
        rank0 = engine.executor.kv_tiers.disk.dir
    finally:
        engine.close()
    assert got == {name: w[0] for name, w in want.items()}
    folders = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(folders) == 2 and rank0 in folders, folders  # one folder (fingerprint) per rank
    rank1 = next(p for p in folders if p != rank0)
    names = {str(p.relative_to(rank0)) for p in rank0.glob("*/*.kv")}
    assert names and names == {str(p.relative_to(rank1)) for p in rank1.glob("*/*.kv")}
    b3, c2 = block_name(pairs["b"][0], 3), block_name(pairs["c"][0], 2)
    assert (rank0 / b3).read_bytes() != (rank1 / b3).read_bytes()  # each rank its own KV head's bytes
    size = {folder: (folder / b3).stat().st_size for folder in (rank0, rank1)}  # every block's file, per rank
    (rank1 / b3).write_bytes((rank1 / b3).read_bytes()[:500])  # torn on rank 1 only
    (rank0 / c2).write_bytes((rank1 / c2).read_bytes())  # rank 1's shard under rank 0's name: foreign

    engine = PagedGenerator(model, **tp)
    try:
        got, counts = {}, {}
        for name, pair in pairs.items():
            got[name] = ids(engine, pair[1])
            counts[name] = tiers(engine)
    finally:
        engine.close()  # the workers write what they queued before they exit
    assert got == {name: w[1] for name, w in want.items()}
    assert counts["a"]["disk_hits"] == 7 and counts["a"]["disk_misses"] == 0  # every block, on both ranks
    assert counts["b"]["disk_hits"] == 7 + 3 and counts["b"]["disk_misses"] == 1  # stops at rank 1's torn file
    # and at rank 0's foreign file, which rank 0's read-ahead already skipped (and deleted): no rank is asked
    assert counts["c"]["disk_hits"] == 10 + 2 and counts["c"]["disk_misses"] == 1
    assert counts["c"]["disk_files_skipped"] == 1  # rank 0's counters: its own foreign file
    for folder in (rank0, rank1):  # the recomputed blocks were written again, by every rank
        for name in (b3, c2):
            assert (folder / name).stat().st_size == size[folder], (folder, name)

    with PagedGenerator(model, prefix_cache_dir=str(tmp_path), **ENGINE) as one:  # another layout: not its files
        assert ids(one, pairs["a"][1]) == want["a"][1]
        assert tiers(one)["disk_hits"] == 0


def test_int8_kv_pool_with_the_disk_tier_under_tensor_parallelism(tmp_path):
    """An int8 pool's blocks go to disk as they are (rows and scales), per rank: exact after a restart."""
    model = make_model("llama")
    first, second = prefix_pair(1)
    settings = dict(kv_cache_dtype="int8", max_itl_ratio=None, **ENGINE)
    with PagedGenerator(model, enable_prefix_caching=False, **settings) as plain:
        want = ids(plain, second)
    for i in range(2):  # the second engine is a restart on the folder
        engine = PagedGenerator(model, tensor_parallel_size=2, prefix_cache_dir=str(tmp_path), **settings)
        try:
            assert engine.pool.cache_dtype == torch.int8
            got = ids(engine, first if i == 0 else second)
            counts = tiers(engine)
        finally:
            engine.close()
    assert got == want
    assert counts["disk_hits"] == 7


class OneRankStore:
    """One rank's store for the agreement alone: ``load`` answers ``ok`` (or raises), ``discard`` is recorded."""

    def __init__(self, ok: bool | Exception) -> None:
        self.ok = ok
        self.discarded: list[bytes] = []

    def load(self, block_hash, slot):
        if isinstance(self.ok, Exception):
            raise self.ok
        return self.ok

    def discard(self, block_hash):
        self.discarded.append(block_hash)


def test_a_rank_agrees_even_when_its_read_raises_and_drops_a_good_file_the_others_lack():
    """Every rank reaches the all-reduce whatever its read did (a rank that skipped it would hang the others), and
    a good file whose partner on another rank is bad is deleted, so the recompute writes both again."""
    answers = []

    def agree_with(others: int):
        def agree(mine: int) -> int:
            answers.append(mine)
            return min(mine, others)
        return agree

    broken = OneRankStore(OSError("disk gone"))
    assert load_and_agree(broken, b"h", 0, agree_with(1)) is False and answers == [0]
    good = OneRankStore(True)
    assert load_and_agree(good, b"h", 0, agree_with(0)) is False and good.discarded == [b"h"]
    assert load_and_agree(good, b"k", 1, agree_with(1)) is True and good.discarded == [b"h"]
    assert serve_tier_message(None, DiskLoad(b"h", 0), agree_with(1)) is True and answers[-1] == 0  # no store
    assert serve_tier_message(good, "a step", agree_with(1)) is False
