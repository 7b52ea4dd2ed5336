"""Bucketed static-shape decode (hf_paged/executor/decode_buckets.py): buckets, padding, persistent buffers, the
"static" eager replay that CUDA graphs and inductor share, inductor on CPU, and CUDA graphs (gpu marker)."""

import logging

import pytest
import torch

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.kernels.cpu import attention as cpu_attention
from hf_paged.kernels.cpu.native_gemm import NATIVE_GEMM
from hf_paged.executor.native_program import DecodeProgram
from hf_paged.executor.program_fit import why_not
from hf_paged.executor.decode_buckets import check_buckets, default_buckets
from tests.arch_configs import make_arch_model
from tests.helpers import make_model, make_prompts, stock_greedy

STATIC = {"decode_runner": "static", "decode_buckets": [1, 2, 4], "max_num_seqs": 6, "block_size": 4, "num_blocks": 256}


def run(engine: PagedGenerator, prompts, max_tokens: list[int], late: int = 0) -> list[list[int]]:
    """Greedy tokens; the last ``late`` prompts join after a few steps, and requests leave at different times,
    so the decode batch passes through 1, a bucket, a bucket + 1 and more sequences than the largest bucket."""
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[: len(prompts) - late], params)]
    results: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests() or len(ids) < len(prompts):
        if steps == 3:
            ids += [engine.add_request(p, sp) for p, sp in zip(prompts[len(ids):], params[len(ids):])]
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert engine.kv_manager.num_used_blocks == 0
    return [results[i] for i in ids]


def test_default_buckets_and_choice():
    assert default_buckets(128) == (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128)
    assert default_buckets(5) == (1, 2, 4, 5)
    assert default_buckets(1) == (1,)
    assert check_buckets([1, 3, 8], 8) == (1, 3, 8)
    model = make_model("llama", seed=3)
    engine = PagedGenerator(model, **STATIC)
    d = engine.executor.runner.fast
    assert [d.bucket_for(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    engine.close()


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"enforce_eager": "yes"}, TypeError, "enforce_eager must be a bool"),
        ({"decode_buckets": [0, 2]}, ValueError, "decode_buckets must be >= 1"),
        ({"decode_buckets": [4, 2]}, ValueError, "strictly increasing"),
        ({"decode_buckets": [2, 2]}, ValueError, "strictly increasing"),
        ({"decode_buckets": [1, 2.5]}, TypeError, "must hold ints"),
        ({"decode_buckets": [True]}, TypeError, "must hold ints"),
        ({"decode_buckets": "1,2"}, TypeError, "list of ints"),
        ({"decode_buckets": []}, ValueError, "must not be empty"),
        ({"decode_buckets": [1, 256], "max_num_seqs": 128}, ValueError, "above max_num_seqs=128"),
        ({"decode_runner": "tensorrt"}, ValueError, "decode_runner must be one of"),
        ({"decode_runner": "cuda_graphs"}, ValueError, "needs a CUDA model"),
        ({"decode_runner": "inductor", "prepack_weights": "onednn"}, ValueError, "conflicts"),
    ],
)
def test_bad_config_is_refused(config, error, match):
    model = make_model("llama", seed=3)
    with pytest.raises(error, match=match):
        PagedGenerator(model, num_blocks=64, **config)
    assert model.config._attn_implementation == "sdpa"  # a refused engine leaves the model as it was


def test_auto_on_cpu_picks_the_program_exactly_where_it_fits_and_enforce_eager_never_does():
    """The contract of the default choice, not one host's outcome: ``auto`` on CPU takes the native decode program
    exactly where the engine's own layers fit it (which packing wins is timed on the host, and a timing taken
    earlier in the process may differ from a fresh one), and ``enforce_eager`` never takes a fast runner."""
    model = make_model("llama", seed=3)
    for config in ({}, {"prepack_weights": False}, {"prepack_weights": "native"}):
        with PagedGenerator(model, num_blocks=64, **config) as engine:
            ex = engine.executor
            fits = not why_not(model, ex.fused, ex.packed) and cpu_attention.available(ex.pool.cache_dtype)
            assert isinstance(ex.runner.fast, DecodeProgram) if fits else ex.runner.fast is None, (config, fits)
            if config.get("prepack_weights") is False:
                assert ex.runner.fast is None  # the program runs on packed (or quantized) linears only
            if config.get("prepack_weights") == "native" and NATIVE_GEMM.load() is not None:
                assert fits  # our GEMM packed and the fused layers: this model fits the program
    for config in ({}, {"decode_runner": "static"}, {"decode_runner": "native", "prepack_weights": "native"}):
        with PagedGenerator(model, num_blocks=64, enforce_eager=True, **config) as engine:
            assert engine.executor.runner.fast is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2"])
def test_static_buckets_equal_eager_and_stock_generate(arch):
    """Bucket edges 1, bucket, bucket + 1 and above the largest bucket, with requests joining and leaving."""
    model = make_arch_model(arch, seed=1)
    prompts = make_prompts(6, lengths=[5, 17, 9, 30, 3, 12], seed=4)
    max_tokens = [6, 9, 12, 15, 18, 21]
    eager = PagedGenerator(model, enforce_eager=True, block_size=4, num_blocks=256, max_num_seqs=6)
    want = run(eager, prompts, max_tokens, late=2)
    eager.close()
    engine = PagedGenerator(model, **STATIC)
    got = run(engine, prompts, max_tokens, late=2)
    d = engine.executor.runner.fast
    assert got == want
    assert d.num_replays > 0 and {b for b, _ in d.graphs} == {1, 2, 4}  # every bucket served a step
    engine.close()
    for prompt, tokens, m in zip(prompts[:3], want, max_tokens):
        assert tokens == stock_greedy(model, prompt, m, eos_token_id=-1)


def test_static_buckets_on_the_default_model():
    from hf_paged.model.default_model import load_default

    model, tok = load_default()
    prompts = [tok(t)["input_ids"] for t in ("The capital of France is", "Once upon a time", "def add(a, b):")]
    engine = PagedGenerator(model, tok, decode_runner="static", decode_buckets=[2, 4], max_num_seqs=4, num_blocks=64)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert engine.executor.runner.fast.num_replays > 0
    engine.close()
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == stock_greedy(model, prompt, 12, eos_token_id=-1)


def _snapshot(engine):
    return [(k.clone(), v.clone()) for k, v in engine.pool.kv_caches]


def test_padding_never_writes_the_pool():
    """Free blocks filled with NaN stay NaN, and a padded step changes exactly its real tokens' slots."""
    model = make_model("llama", seed=3)
    engine = PagedGenerator(model, **STATIC)
    prompts = make_prompts(3, lengths=[5, 6, 7], seed=2)  # the next token stays in the last prompt block
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill all three (and sample their first token)
    tables = {r.seq_id: list(engine.kv_manager.get_block_ids(r.seq_id)) for r in engine.scheduler.running}
    held = {b for t in tables.values() for b in t}
    free = sorted(set(range(engine.pool.num_blocks)) - held)
    assert 0 in free or 0 in held
    for k, v in engine.pool.kv_caches:
        k[free] = float("nan")
        v[free] = float("nan")
    before = _snapshot(engine)
    slots = {r.seq_id: tables[r.seq_id][r.num_computed_tokens // 4] * 4 + r.num_computed_tokens % 4
             for r in engine.scheduler.running}
    replays = engine.executor.runner.fast.num_replays
    outs = engine.step()  # 3 sequences padded to bucket 4
    assert engine.executor.runner.fast.num_replays == replays + 1
    assert all(o.outputs[0].finish_reason is None for o in outs)
    real = torch.zeros(engine.pool.num_blocks * 4, dtype=torch.bool)
    real[list(slots.values())] = True
    for (k0, v0), (k1, v1) in zip(before, engine.pool.kv_caches):
        for old, new in ((k0, k1), (v0, v1)):
            old, new = old.flatten(0, 1), new.flatten(0, 1)
            same = (old == new) | (old.isnan() & new.isnan())
            assert same[~real].all(), "a padding row wrote the pool"
            assert not same[real].any() and new[real].isfinite().all()
            assert new.view(engine.pool.num_blocks, 4, -1)[free].isnan().all()
    engine.close()


def test_in_place_weight_change_is_seen_by_static_buckets():
    model = make_model("llama", seed=5)
    prompts = make_prompts(3, seed=9)
    engine = PagedGenerator(model, **STATIC)
    first = run(engine, prompts, [8, 8, 8])
    with torch.no_grad():
        saved = model.lm_head.weight.clone()
        model.lm_head.weight.mul_(-1.0)
    try:
        flipped = run(engine, prompts, [8, 8, 8])
        eager = PagedGenerator(model, enforce_eager=True, block_size=4, num_blocks=256)
        assert flipped == run(eager, prompts, [8, 8, 8]) != first
        eager.close()
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(saved)
    engine.close()


def test_speculative_verification_steps_use_buckets_of_1_plus_k():
    """A step whose sequences all verify the same number of drafts runs in a (bucket, 1 + k) shape; uneven
    draft counts in one step run eagerly. Greedy output is the same either way."""
    model = make_model("llama", seed=3)
    prompts = [p * 4 for p in make_prompts(3, lengths=[6, 7, 8], seed=3)]  # repetitive: drafts get accepted
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    eager = PagedGenerator(model, enforce_eager=True, block_size=4, num_blocks=256, speculative_config=spec)
    want = run(eager, prompts, [16, 16, 16])
    alone = [run(eager, [p], [24])[0] for p in prompts]
    eager.close()
    engine = PagedGenerator(model, speculative_config=spec, **STATIC)
    assert run(engine, prompts, [16, 16, 16]) == want
    assert [run(engine, [p], [24])[0] for p in prompts] == alone  # one sequence: every step is uniform
    assert engine.stats().spec_num_drafts > 0
    assert {q for _, q in engine.executor.runner.fast.graphs} >= {1, 3}
    engine.close()


def test_inductor_equals_eager_and_reuses_compiled_code(tmp_path, monkeypatch):
    """Each bucket compiles once; a second engine start reuses the compiled kernels from the disk cache."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = make_model("llama", seed=3)
    prompts = make_prompts(2, lengths=[5, 9], seed=5)
    eager = PagedGenerator(model, enforce_eager=True, block_size=4, num_blocks=256)
    want = run(eager, prompts, [6, 6])
    eager.close()
    compiled = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        engine = PagedGenerator(model, decode_runner="inductor", decode_buckets=[2], max_num_seqs=2, block_size=4,
                                num_blocks=256)
        assert engine.packed is None  # our packed linears would break the graph
        assert run(engine, prompts, [6, 6]) == want
        d = engine.executor.runner.fast
        assert d.disabled_reason is None and d.num_builds == 1 and d.num_replays >= 5
        compiled.append(_cache_counts(counters))
        engine.close()
    assert compiled[0]["miss"] >= 1 and compiled[1]["miss"] == 0 and compiled[1]["hit"] >= 1, compiled


def _cache_counts(counters) -> dict[str, int]:
    c = counters["inductor"]
    return {"hit": c["fxgraph_cache_hit"], "miss": c["fxgraph_cache_miss"]}


def _bucket_engine_and_eager_tokens(mode: str):
    """Three prompts, their eager tokens (7 each) and an engine of decode buckets [2, 4] in ``mode``."""
    model = make_model("llama", seed=3)
    prompts = make_prompts(3, seed=6)
    eager = PagedGenerator(model, enforce_eager=True, block_size=4, num_blocks=256)
    want = run(eager, prompts, [7, 7, 7])
    eager.close()
    engine = PagedGenerator(model, decode_runner=mode, decode_buckets=[2, 4], max_num_seqs=4, block_size=4,
                            num_blocks=256)
    return prompts, want, engine


def test_a_model_that_cannot_compile_falls_back_to_eager_with_one_warning(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler on this machine")

    monkeypatch.setattr(torch, "compile", broken)
    prompts, want, engine = _bucket_engine_and_eager_tokens("inductor")
    with caplog.at_level(logging.WARNING, logger="hf_paged.executor.decode_buckets"):
        assert run(engine, prompts, [7, 7, 7]) == want
    warnings = [r for r in caplog.records if r.name == "hf_paged.executor.decode_buckets"]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].getMessage()
    assert "no C++ compiler" in engine.executor.runner.fast.disabled_reason
    engine.close()


def test_buckets_stop_everywhere_when_another_rank_could_not_build_one():
    """Under tensor parallelism the ranks agree whether a bucket was built (a padded step and an eager one run
    collectives of different sizes): here the other ranks said no, so this one decodes eagerly too."""
    prompts, want, engine = _bucket_engine_and_eager_tokens("static")
    votes = []
    engine.executor.runner.fast.agree = lambda ok: votes.append(ok) or 0  # as the MIN all-reduce over the ranks
    assert run(engine, prompts, [7, 7, 7]) == want
    fast = engine.executor.runner.fast
    assert votes == [1] and fast.num_replays == 0 and "another tensor-parallel rank" in fast.disabled_reason
    engine.close()


@pytest.mark.gpu
def test_cuda_graphs_equal_eager_on_cuda():
    model = make_model("llama", seed=3).cuda()
    try:
        prompts = make_prompts(6, lengths=[5, 17, 9, 30, 3, 12], seed=4)
        eager = PagedGenerator(model, enforce_eager=True, block_size=4, num_blocks=256, max_num_seqs=6)
        want = run(eager, prompts, [6, 9, 12, 15, 18, 21], late=2)
        eager.close()
        engine = PagedGenerator(model, decode_buckets=[1, 2, 4], max_num_seqs=6, block_size=4, num_blocks=256)
        assert engine.executor.runner.fast.mode == "cuda_graphs"
        assert run(engine, prompts, [6, 9, 12, 15, 18, 21], late=2) == want
        assert engine.executor.runner.fast.num_replays > 0 and engine.executor.runner.fast.disabled_reason is None
        engine.close()
    finally:
        model.cpu()
