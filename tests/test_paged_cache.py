"""PagedCache: stock generate parity with DynamicCache, copy-on-write at the block level, memory, errors."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.bench.cache_memory import dynamic_cache_kv_bytes, measure_beam_memory
from hf_paged.core.block_pool import BlockPool
from hf_paged.core.kv_cache_manager import OutOfBlocksError
from hf_paged.hf.cache import CACHE_KWARG, PagedCache
from tests.helpers import make_model, make_prompts

KVH, D = 2, 4


def _batch(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _generate(model, prompts, cache=None, seed=None, **kw):
    ids, mask = _batch(prompts)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **{CACHE_KWARG: cache}, pad_token_id=0, **kw)


def _kv(rows: int, q: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, KVH, q, D, generator=g), torch.randn(rows, KVH, q, D, generator=g)


def _same_rows(k: torch.Tensor, v: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return k[:1].expand(rows, -1, -1, -1).clone(), v[:1].expand(rows, -1, -1, -1).clone()


class Mirror:
    """Feeds the same updates to a PagedCache and a DynamicCache and checks they return the same K/V."""

    def __init__(self, block_size: int = 4, num_layers: int = 2, **kw) -> None:
        self.paged = PagedCache(make_model("llama"), block_size=block_size, **kw)
        self.dynamic = DynamicCache()
        self.num_layers = num_layers

    def step(self, k: torch.Tensor, v: torch.Tensor) -> None:
        for layer in range(self.num_layers):
            # later layers see other values, as in a model (same rows stay same unless a test says otherwise)
            lk, lv = k + layer, v - layer
            pk, pv = self.paged.update(lk, lv, layer)
            dk, dv = self.dynamic.update(lk, lv, layer)
            assert torch.equal(pk, dk) and torch.equal(pv, dv), f"layer {layer} K/V differ from DynamicCache"
        self.paged.check_consistency()

    def reorder(self, idx: list[int]) -> None:
        self.paged.reorder_cache(torch.tensor(idx))
        self.dynamic.reorder_cache(torch.tensor(idx))
        self.paged.check_consistency()

    def ref_cnts(self) -> dict[int, int]:
        return {b.block_id: b.ref_cnt for b in self.paged.tables.pool.blocks if b.ref_cnt}


# -- stock generate parity --


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_matches_dynamic_cache(block_size):
    model = make_model("llama")
    prompts = make_prompts(3, [37, 5, 20], seed=1)
    ref = _generate(model, prompts, DynamicCache(), max_new_tokens=24, do_sample=False)
    cache = PagedCache(model, block_size=block_size)
    out = _generate(model, prompts, cache, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == out.shape[1] - 1
    cache.check_consistency()


def test_seeded_sampling_matches_dynamic_cache():
    model = make_model("llama")
    prompts = make_prompts(2, [30, 12], seed=2)
    kw = dict(max_new_tokens=20, do_sample=True, top_k=50, temperature=1.3, num_return_sequences=3, seed=7)
    ref = _generate(model, prompts, DynamicCache(), **kw)
    cache = PagedCache(model)
    out = _generate(model, prompts, cache, **kw)
    assert torch.equal(out, ref)
    assert not torch.equal(out[0], out[1]), "samples of one prompt should differ (else the test is vacuous)"
    cache.check_consistency()


@pytest.mark.parametrize("num_return_sequences", [1, 2])
def test_beam_search_matches_dynamic_cache(num_return_sequences):
    model = make_model("llama")
    prompts = make_prompts(2, [45, 19], seed=3)
    kw = dict(
        max_new_tokens=24, num_beams=4, num_return_sequences=num_return_sequences, do_sample=False,
        return_dict_in_generate=True, output_scores=True,
    )
    ref = _generate(model, prompts, DynamicCache(), **kw)
    cache = PagedCache(model, block_size=8)
    out = _generate(model, prompts, cache, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.sequences_scores, ref.sequences_scores)
    assert cache.batch_size == 8
    cache.check_consistency()
    # beams of one prompt share its (fully written) prompt blocks: 45 tokens -> 5 full blocks of 8
    tables = cache.block_tables()
    assert all(t[:5] == tables[0][:5] for t in tables[:4])
    assert all(cache.tables.pool.blocks[b].ref_cnt == 4 for b in tables[0][:5])


def test_sliding_window_model():
    model = make_model("mistral")  # window 48, shorter than the prompt
    prompts = make_prompts(2, [80, 60], seed=4)
    for kw in (dict(do_sample=False), dict(num_beams=3, do_sample=False)):
        ref = _generate(model, prompts, None, max_new_tokens=20, **kw)  # stock: sliding DynamicCache layers
        cache = PagedCache(model, block_size=16)
        out = _generate(model, prompts, cache, max_new_tokens=20, **kw)
        assert torch.equal(out, ref), kw
        assert cache.get_seq_length() == out.shape[1] - 1  # the full cache is kept
        cache.check_consistency()


def test_no_leak_after_generate_and_reset():
    model = make_model("llama")
    cache = PagedCache(model, block_size=4)
    _generate(model, make_prompts(2, [21, 9], seed=5), cache, max_new_tokens=15, num_beams=4)
    cache.check_consistency()
    used = {b for t in cache.block_tables() for b in t}
    assert cache.tables.num_used_blocks == len(used)
    cache.reset()
    cache.check_consistency()
    assert cache.tables.pool.num_free_blocks == cache.tables.num_blocks
    assert cache.get_seq_length() == 0 and cache.batch_size == -1
    # a reset cache serves the next generate, reusing its pool
    num_blocks = cache.tables.num_blocks
    ref = _generate(model, make_prompts(1, [10], seed=6), None, max_new_tokens=8, do_sample=False)
    out = _generate(model, make_prompts(1, [10], seed=6), cache, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref) and cache.tables.num_blocks == num_blocks


def test_continuation_and_reuse_across_inference_mode():
    model = make_model("llama")
    prompt = make_prompts(1, [13], seed=9)
    ref = _generate(model, prompt, None, max_new_tokens=10, do_sample=False)
    cache = PagedCache(model, block_size=4)
    first = _generate(model, prompt, cache, max_new_tokens=4, do_sample=False)
    out = _generate(model, first.tolist(), cache, max_new_tokens=6, do_sample=False)  # continues the cached prefix
    assert torch.equal(out, ref)
    cache.reset()
    with torch.inference_mode():
        _generate(model, prompt, cache, max_new_tokens=3)
    cache.reset()
    assert torch.equal(_generate(model, prompt, cache, max_new_tokens=10, do_sample=False), ref)


# -- copy-on-write, block by block --


def test_beam_reorder_shares_blocks_and_copies_only_partial_ones():
    m = Mirror(block_size=4)
    k, v = _kv(1, 6, seed=0)
    m.step(*_same_rows(k, v, 3))  # the 3 beam copies of a 6-token prompt are stored once
    assert m.paged.block_tables() == [[0, 1]] * 3
    assert m.ref_cnts() == {0: 3, 1: 3}

    m.step(*_kv(3, 1, seed=1))  # each beam writes token 6 into the shared, half-filled block 1
    assert m.paged.block_tables() == [[0, 2], [0, 3], [0, 1]]  # two copies, the last writer keeps block 1
    assert m.ref_cnts() == {0: 3, 1: 1, 2: 1, 3: 1}

    m.reorder([2, 2, 0])  # tables move, nothing is copied
    assert m.paged.block_tables() == [[0, 1], [0, 1], [0, 2]]
    assert m.ref_cnts() == {0: 3, 1: 2, 2: 1}
    assert m.paged.tables.pool.free_block_ids() == [3]

    m.step(*_kv(3, 1, seed=2))  # token 7: rows 0 and 1 share partial block 1 -> one copy (block 3)
    assert m.paged.block_tables() == [[0, 3], [0, 1], [0, 2]]
    assert m.ref_cnts() == {0: 3, 1: 1, 2: 1, 3: 1}

    m.reorder([1, 1, 1])  # block 1 is full now (tokens 4..7)
    assert m.ref_cnts() == {0: 3, 1: 3}
    m.step(*_kv(3, 1, seed=3))  # token 8 opens new blocks; the full shared blocks are never copied
    tables = m.paged.block_tables()
    assert [t[:2] for t in tables] == [[0, 1]] * 3 and len({t[2] for t in tables}) == 3
    assert m.ref_cnts()[0] == 3 and m.ref_cnts()[1] == 3

    m.paged.reset()
    m.paged.check_consistency()
    assert m.paged.tables.pool.num_free_blocks == m.paged.tables.num_blocks


def test_rows_that_diverge_in_a_later_layer_get_private_blocks():
    m = Mirror(block_size=4, num_layers=3)
    k, v = _same_rows(*_kv(1, 6, seed=0), 2)
    for layer in range(3):
        lk, lv = k.clone(), v.clone()
        if layer == 2:
            lk[1, 0, 5] += 1  # row 1 differs from row 0 only in layer 2's last token
        pk, pv = m.paged.update(lk, lv, layer)
        dk, dv = m.dynamic.update(lk, lv, layer)
        assert torch.equal(pk, dk) and torch.equal(pv, dv), layer
    m.paged.check_consistency()
    t0, t1 = m.paged.block_tables()
    assert t0 != t1 and set(t0).isdisjoint(t1)  # both blocks held tokens of this step, so both were copied
    m.step(*_kv(2, 3, seed=1))  # and later steps still read what every layer wrote


def test_batch_repeat_interleave_select_and_crop():
    m = Mirror(block_size=4)
    m.step(*_kv(2, 5, seed=0))
    assert m.paged.block_tables() == [[0, 1], [2, 3]]
    for c in (m.paged, m.dynamic):
        c.batch_repeat_interleave(2)
    assert m.paged.block_tables() == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert m.ref_cnts() == {0: 2, 1: 2, 2: 2, 3: 2}
    m.step(*_kv(4, 2, seed=1))
    for c in (m.paged, m.dynamic):
        c.batch_select_indices(torch.tensor([3, 0]))
    m.paged.check_consistency()
    assert m.paged.batch_size == 2
    for c in (m.paged, m.dynamic):
        c.crop(-4)  # 7 -> 3 tokens: the second block of each row goes back
    assert m.paged.get_seq_length() == 3 and all(len(t) == 1 for t in m.paged.block_tables())
    m.paged.check_consistency()
    m.step(*_kv(2, 6, seed=2))


def test_cache_api_answers():
    m = Mirror(block_size=4)
    c = m.paged
    assert c.get_seq_length() == 0 and c.get_mask_sizes(5, 0) == (5, 0) and not c.is_initialized
    m.step(*_kv(2, 5, seed=0))
    assert c.get_seq_length() == 5 and c.get_mask_sizes(1, 1) == (6, 0)
    assert c.get_max_length() == -1 and c.is_compileable is False and c.is_croppable and c.is_initialized
    with pytest.raises(ValueError, match="3"):
        c.crop(3)


# -- memory --


def test_paged_cache_uses_less_memory_than_dynamic_cache_for_beams():
    model = make_model("llama")
    ids = torch.tensor(make_prompts(1, [200], seed=7))
    mem = measure_beam_memory(model, ids, max_new_tokens=20, num_beams=4, block_size=16)
    assert mem.same_tokens
    # DynamicCache: 4 beams x 219 tokens; PagedCache: the 200-token prompt once plus each beam's tail
    assert mem.paged_used_bytes <= mem.paged_peak_bytes <= mem.paged_reserved_bytes
    assert mem.paged_reserved_bytes < 0.5 * mem.dynamic_bytes


def test_dynamic_cache_kv_bytes():
    cache = DynamicCache()
    k, v = _kv(2, 3, seed=0)
    cache.update(k, v, 0)
    assert dynamic_cache_kv_bytes(cache) == 2 * k.nbytes


# -- pool sizing and errors --


def test_fixed_pool_runs_out_with_a_clear_error():
    model = make_model("llama")
    cache = PagedCache(model, block_size=4, max_tokens=10)  # 3 blocks
    assert cache.tables.num_blocks == 3
    with pytest.raises(OutOfBlocksError, match="num_blocks=3"):
        _generate(model, make_prompts(1, [20], seed=8), cache, max_new_tokens=4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=0), "0"),
        (dict(block_size=12), "12"),
        (dict(num_blocks=0), "0"),
        (dict(max_tokens=-5), "-5"),
        (dict(num_blocks=4, max_tokens=64), "num_blocks or max_tokens"),
    ],
)
def test_bad_constructor_values_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedCache(make_model("llama"), **kwargs)


def test_bad_constructor_types_raise_type_error():
    with pytest.raises(TypeError, match="'16'"):
        PagedCache(make_model("llama"), block_size="16")
    with pytest.raises(TypeError, match="str"):
        PagedCache("not a model")


def test_block_pool_grow_appends_free_blocks():
    pool = BlockPool(2)
    held = pool.get_new_blocks(2)
    pool.grow(3)
    assert pool.num_blocks == 5 and pool.free_block_ids() == [2, 3, 4]
    pool.check_consistency([b.block_id for b in held])
    with pytest.raises(ValueError, match="0"):
        pool.grow(0)


def test_exported_from_package():
    assert hf_paged.PagedCache is PagedCache
