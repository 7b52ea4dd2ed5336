"""The engine's memory features end to end: prefix caching, n > 1 forks, beam search, swap, priority, stats.

Greedy outputs are compared token for token with stock ``generate`` (fp32); beam search with stock
``generate(num_beams=...)`` (sequences equal, scores within 1e-5).
"""

import pytest
import torch

import hf_paged
from hf_paged import BeamSearchParams, PagedGenerator, SamplingParams
from tests.helpers import make_model, make_prompts, stock_greedy

NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts(n=6, prefix_len=45, seed=11):
    prefix = make_prompts(1, [prefix_len], seed=seed)[0]
    tails = make_prompts(n, [1 + 7 * i for i in range(n)], seed=seed + 1)
    return [prefix + t for t in tails]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_prefix_cache_hits_keep_greedy_parity(arch):
    model = make_model(arch)
    prompts = shared_prefix_prompts()
    want = [stock_greedy(model, p, NEW) for p in prompts]
    engine = PagedGenerator(model, block_size=4, num_blocks=400, max_num_batched_tokens=64)
    first = engine.generate(prompts[:1], GREEDY, use_tqdm=False)  # fills the cache with the shared prefix
    rest = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert first[0].token_ids == want[0] and [o.token_ids for o in rest] == want
    assert all(o.num_cached_tokens >= 44 for o in rest)  # 11 full blocks of the 45-token prefix
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 44 * len(prompts) and 0 < stats.prefix_cache_hit_rate < 1
    again = engine.generate(prompts, GREEDY, use_tqdm=False)  # whole prompts cached, last token recomputed
    assert [o.token_ids for o in again] == want
    engine.kv_manager.check_consistency()
    engine.close()


def test_prefix_caching_off_and_on_give_the_same_tokens():
    model = make_model("qwen2")
    prompts = shared_prefix_prompts(seed=3)
    outs = []
    for caching in (False, True):
        with PagedGenerator(model, block_size=8, num_blocks=200, enable_prefix_caching=caching) as engine:
            runs = [[o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] for _ in range(2)]
            assert runs[0] == runs[1]
            assert (engine.stats().prefix_cache_hits > 0) == caching
        outs.append(runs[0])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_parity_under_preemption(arch, mode):
    model = make_model(arch)
    prompts = make_prompts(8, [3, 20, 51, 9, 70, 33, 14, 60], seed=21)
    want = [stock_greedy(model, p, 24) for p in prompts]
    # unpaced (max_itl_ratio=None): the pacer's chunk sizes come from measured step times, and this case needs the
    # crowded pool that full-budget prefill chunks make
    engine = PagedGenerator(model, block_size=4, num_blocks=60, max_num_batched_tokens=96,
                            preemption_mode=mode, swap_space=1 << 20, max_itl_ratio=None)
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert engine.stats().num_preemptions[mode] > 0
    engine.kv_manager.check_consistency()
    assert engine.kv_manager.num_used_blocks == 0
    engine.close()


def test_n_samples_each_equal_their_seed_run_alone_and_share_the_prompt_blocks():
    model = make_model("llama")
    prompt = make_prompts(1, [37], seed=2)[0]
    engine = PagedGenerator(model, block_size=4, num_blocks=200, enable_prefix_caching=False)
    params = dict(max_tokens=12, temperature=0.8, top_k=50, ignore_eos=True)
    group = engine.generate([prompt], SamplingParams(n=4, seed=100, **params), use_tqdm=False)[0]
    alone = [engine.generate([prompt], SamplingParams(seed=100 + i, **params), use_tqdm=False)[0] for i in range(4)]
    assert [c.index for c in group.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in group.outputs] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1
    assert group.token_ids == group.outputs[0].token_ids and group.finished
    engine.close()


def test_n_samples_use_a_quarter_of_the_blocks_of_separate_requests():
    model = make_model("llama")
    prompt = make_prompts(1, [512], seed=4)[0]
    params = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True, seed=1)
    peaks = []
    for requests in ([(prompt, params.clone(n=8))], [(prompt, params.clone(seed=i)) for i in range(8)]):
        engine = PagedGenerator(model, block_size=16, num_blocks=600, max_num_batched_tokens=4096,
                                enable_prefix_caching=False)
        for p, sp in requests:
            engine.add_request(p, sp)
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.kv_manager.num_used_blocks)
        peaks.append(peak)
        engine.close()
    assert peaks[0] * 4 <= peaks[1], peaks  # 32 shared prompt blocks + 8 x 3 private vs 8 x 35


def beam_kwargs(**kw):
    return {**dict(max_new_tokens=10, num_beams=3, do_sample=False, pad_token_id=0), **kw}


def left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(num_return_sequences=3, length_penalty=0.5, early_stopping=True),
        dict(num_return_sequences=2, early_stopping="never", length_penalty=1.5),
        dict(num_beams=4, repetition_penalty=1.3, min_new_tokens=3),
    ],
)
def test_wrapped_beam_search_equals_stock(arch, kw):
    model = make_model(arch)
    prompts = make_prompts(3, [5, 31, 60], seed=8)
    ids, mask = left_padded(prompts)
    eos = stock_greedy(model, prompts[1], 6)[3]  # a token the search really meets, so beams finish early
    call = dict(attention_mask=mask, eos_token_id=eos, return_dict_in_generate=True, output_scores=True,
                **beam_kwargs(**{**kw}))
    with torch.no_grad():
        want = model.generate(ids, **call)
    hf_paged.wrap(model, block_size=4, num_blocks=400)
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # runs in the engine: no fallback warning
            got = model.generate(ids, **call)
        engine = model.paged
        assert torch.equal(got.sequences, want.sequences)
        torch.testing.assert_close(got.sequences_scores, want.sequences_scores, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.beam_indices, want.beam_indices)
        assert len(got.scores) == len(want.scores)
        for a, b in zip(got.scores, want.scores):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        plain = model.generate(ids, attention_mask=mask, eos_token_id=eos, **beam_kwargs(**kw))
        assert torch.equal(plain, want.sequences)
        engine.kv_manager.check_consistency()
        assert engine.kv_manager.num_used_blocks == 0  # every beam freed
    finally:
        hf_paged.unwrap(model)


def test_engine_beam_search_shares_blocks_and_frees_pruned_beams():
    model = make_model("llama")
    prompts = make_prompts(2, [40, 23], seed=9)
    engine = PagedGenerator(model, block_size=4, num_blocks=300, enable_prefix_caching=False)
    peak = {"used": 0}
    original = engine.step

    def step():
        out = original()
        peak["used"] = max(peak["used"], engine.kv_manager.num_used_blocks)
        return out

    engine.step = step
    results = engine.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=8, num_return_sequences=2))
    with torch.no_grad():
        for prompt, result in zip(prompts, results):
            want = model.generate(torch.tensor([prompt]), num_beams=4, max_new_tokens=8, num_return_sequences=2,
                                  do_sample=False, pad_token_id=0, eos_token_id=None, output_scores=True,
                                  return_dict_in_generate=True)
            assert [s.token_ids for s in result.sequences] == want.sequences[:, len(prompt):].tolist()
            assert [round(s.score, 4) for s in result.sequences] == [round(x, 4) for x in want.sequences_scores.tolist()]
    # 4 beams x (40 or 23 prompt + 8) tokens unshared would need 4 * (12 + 8) = 80 blocks
    assert peak["used"] <= 12 + 8 + 8 * 3, peak
    assert engine.kv_manager.num_used_blocks == 0
    engine.close()


def test_beam_search_on_the_default_model_equals_stock():
    from hf_paged.model.default_model import load_default

    model, tok = load_default()
    chats = [[{"role": "user", "content": "Name a fruit."}], [{"role": "user", "content": "What is 3 + 4?"}]]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    batch = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    call = dict(**batch, max_new_tokens=12, num_beams=3, num_return_sequences=2, do_sample=False,
                return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        want = model.generate(**call)
    hf_paged.wrap(model, tok, max_num_seqs=16)
    try:
        got = model.generate(**call)
    finally:
        hf_paged.unwrap(model)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, atol=1e-5, rtol=1e-5)


def test_priority_scheduling_runs_lower_values_first():
    model = make_model("llama")
    prompts = make_prompts(4, [10, 10, 10, 10], seed=5)
    engine = PagedGenerator(model, block_size=4, num_blocks=100, max_num_seqs=1, scheduling_policy="priority")
    order = []
    for prompt, prio in zip(prompts, [3, 1, 2, 0]):
        engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0), request_id=f"p{prio}", priority=prio)
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["p0", "p1", "p2", "p3"]
    engine.close()


def test_stats_snapshot():
    model = make_model("llama")
    engine = PagedGenerator(model, block_size=4, num_blocks=64)
    prompts = make_prompts(3, [9, 9, 9], seed=1)
    engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)
    s = engine.stats()
    assert isinstance(s, hf_paged.EngineStats)
    assert (s.num_running, s.num_waiting, s.num_swapped, s.num_kv_blocks, s.num_kv_blocks_used) == (0, 0, 0, 64, 0)
    assert s.num_generated_tokens == 15 and s.num_prompt_tokens == 27 and s.num_requests_finished == 3
    assert s.prefix_cache_queries == 27 and s.num_kv_blocks_cached > 0 and s.num_steps >= 5
    engine.close()


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(n=0), ValueError, "n must be >= 1"),
        (dict(n=1.5), TypeError, "n must be an int"),
        (dict(logprobs=-1), ValueError, "logprobs must be >= 0"),
    ],
)
def test_bad_sampling_params(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(beam_width=0), ValueError, "beam_width must be >= 1"),
        (dict(beam_width=2, num_return_sequences=3), ValueError, "num_return_sequences must be in \\[1, 2\\]"),
        (dict(early_stopping="sometimes"), ValueError, "early_stopping"),
        (dict(temperature=0.7), TypeError, "temperature"),  # beam search takes no sampling fields
        (dict(length_penalty="x"), TypeError, "length_penalty"),
    ],
)
def test_bad_beam_search_params(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        BeamSearchParams(**kwargs)


@pytest.mark.parametrize(
    "config,exc,match",
    [
        (dict(swap_space=-1), ValueError, "swap_space must be >= 0"),
        (dict(preemption_mode="evict"), ValueError, "preemption_mode must be one of"),
        (dict(scheduling_policy="lifo"), ValueError, "scheduling_policy must be one of"),
        (dict(enable_prefix_caching="yes"), TypeError, "enable_prefix_caching must be a bool"),
    ],
)
def test_bad_engine_config(config, exc, match):
    with pytest.raises(exc, match=match):
        PagedGenerator(make_model("llama"), num_blocks=16, **config)


def test_bad_priority_and_beam_prompt_leave_running_requests_alone():
    model = make_model("llama")
    prompts = make_prompts(2, [12, 30], seed=6)
    want = [stock_greedy(model, p, 10) for p in prompts]
    engine = PagedGenerator(model, block_size=4, num_blocks=100, max_model_len=64)
    ids = [engine.add_request(p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for p in prompts]
    engine.step()
    with pytest.raises(TypeError, match="priority must be an int, got '1'"):
        engine.add_request([1, 2], priority="1")
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        engine.beam_search([[1] * 60], BeamSearchParams(beam_width=2, max_tokens=8))
    got = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] = o.token_ids
    assert [got[i] for i in ids] == want
    assert engine.kv_manager.num_used_blocks == 0
    engine.close()


def test_stream_gets_every_token_when_another_thread_steps_the_engine():
    """A stream reads its own queue: the final token arrives even if another thread's step produced it."""
    import threading

    model = make_model("llama")
    prompt = make_prompts(1, [9], seed=12)[0]
    want = stock_greedy(model, prompt, 20)
    engine = PagedGenerator(model, block_size=4, num_blocks=100)
    stop = threading.Event()

    def stepper():
        while not stop.is_set():
            if engine.has_unfinished_requests():
                engine.step()

    thread = threading.Thread(target=stepper)
    thread.start()
    try:
        items = list(engine.stream(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    finally:
        stop.set()
        thread.join()
    assert [t for item in items for t in item.token_ids] == want
    assert items[-1].finished and items[-1].finish_reason == "length"
    engine.close()


def test_two_engines_share_the_model_and_the_last_close_restores_it():
    model = make_model("llama")
    prompts = make_prompts(2, [7, 19], seed=13)
    want = [stock_greedy(model, p, 8) for p in prompts]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = PagedGenerator(model, num_blocks=64)
    second = PagedGenerator(model, num_blocks=64)
    second.close()  # must not pull the attention implementation from under `first`
    assert [o.token_ids for o in first.generate(prompts, params, use_tqdm=False)] == want
    with pytest.raises(ValueError):
        PagedGenerator(model, num_blocks=64, max_model_len=10**6)  # a failed constructor changes nothing either
    assert [o.token_ids for o in first.generate(prompts, params, use_tqdm=False)] == want
    first.close()
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="closed"):
        first.generate(prompts, params, use_tqdm=False)
    with pytest.raises(RuntimeError, match="closed"):
        first.step()


def test_step_refuses_to_run_when_the_attention_was_switched_away():
    model = make_model("llama")
    engine = PagedGenerator(model, num_blocks=64)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3))
    model.set_attn_implementation("sdpa")  # behind the engine's back
    with pytest.raises(RuntimeError, match="no longer runs the 'hf_paged' attention"):
        engine.step()
    engine.close()


def test_step_outputs_do_not_copy_token_lists():
    model = make_model("llama")
    engine = PagedGenerator(model, num_blocks=64)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    outs = [o for _ in range(3) for o in engine.step() if o.request_id == rid]
    seq = engine.outputs.state_of(rid).first
    assert all(o.outputs[0]._source is seq.output_token_ids for o in outs)  # a reference and a length
    assert [len(o.token_ids) for o in outs] == [1, 2, 3]  # each a snapshot of its own step
    engine.close()


def test_an_engine_dropped_without_close_gives_the_model_back():
    import gc

    model = make_model("llama")
    PagedGenerator(model, num_blocks=64).generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
    gc.collect()
    assert model.config._attn_implementation == "sdpa"


# -- regressions found in review ------------------------------------------------------------------------


def test_beam_search_completes_when_its_beams_cannot_all_fit_the_pool():
    """Idle beams (their row given, waiting for siblings) are preempted to let a sibling in."""
    model = make_model("llama")
    prompts = make_prompts(2, [30, 11], seed=14)
    params = BeamSearchParams(beam_width=4, max_tokens=20)
    roomy = PagedGenerator(model, block_size=16, num_blocks=200, enable_prefix_caching=False)
    want = [[s.token_ids for s in r.sequences] for r in roomy.beam_search(prompts, params)]
    roomy.close()
    for num_blocks in (6, 10):
        tight = PagedGenerator(model, block_size=16, num_blocks=num_blocks, enable_prefix_caching=False)
        got = [[s.token_ids for s in r.sequences] for r in tight.beam_search(prompts, params)]
        assert got == want and sum(tight.stats().num_preemptions.values()) > 0
        assert tight.kv_manager.num_used_blocks == 0
        tight.close()


def test_beam_search_with_more_prompts_than_max_num_seqs():
    model = make_model("llama")
    prompts = make_prompts(5, [4, 9, 6, 12, 3], seed=15)
    engine = PagedGenerator(model, block_size=4, num_blocks=256, max_num_seqs=4)
    results = engine.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=5))
    with torch.no_grad():
        for prompt, result in zip(prompts, results):
            want = model.generate(torch.tensor([prompt]), num_beams=2, max_new_tokens=5, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
            assert result.sequences[0].token_ids == want[0, len(prompt):].tolist()
    engine.close()


def test_a_failed_step_during_beam_search_raises_instead_of_returning_garbage(monkeypatch):
    model = make_model("llama")
    engine = PagedGenerator(model, block_size=4, num_blocks=256)
    original = engine.executor.runner.compute_logits
    calls = {"n": 0}

    def flaky(inputs, model=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("transient device error")
        return original(inputs, model)

    monkeypatch.setattr(engine.executor.runner, "compute_logits", flaky)
    with pytest.raises(RuntimeError, match="beam search failed: .*transient device error"):
        engine.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=6))
    assert engine.kv_manager.num_used_blocks == 0
    engine.close()


def test_a_failed_sample_of_a_fork_is_reported_and_leaves_no_state(monkeypatch):
    from hf_paged.sample.sampling import SeqState

    model = make_model("llama")
    engine = PagedGenerator(model, block_size=4, num_blocks=128)
    original = SeqState.get_generator

    def broken(self, device):
        if self.seed_offset == 2:
            raise RuntimeError("boom")
        return original(self, device)

    monkeypatch.setattr(SeqState, "get_generator", broken)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=3, ignore_eos=True),
                          use_tqdm=False)[0]
    assert [(c.index, c.finish_reason) for c in out.outputs] == [(0, "length"), (1, "length"), (2, "error")]
    assert "boom" in out.outputs[2].error and out.finished
    engine.step()  # the runner hears that every sequence finished
    assert engine.executor.runner.states == {} and engine.kv_manager.num_used_blocks == 0
    engine.close()


def test_models_with_inference_tensor_weights_work_with_prefix_caching():
    import transformers

    with torch.inference_mode():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
        model = transformers.LlamaForCausalLM(config).eval()
    outs = []
    for caching in (True, False):
        with PagedGenerator(model, num_blocks=64, enable_prefix_caching=caching) as engine:
            outs.append(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0].token_ids)
    assert outs[0] == outs[1]


def _resident_pages(t: torch.Tensor) -> list[bool]:
    """Which whole pages of ``t``'s memory are resident (``mincore``)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    vec = (ctypes.c_ubyte * ((end - start) // page))()
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return [bool(b & 1) for b in vec]


def test_pool_commits_its_pages_ahead_of_use_in_chunks_and_keeps_their_contents(monkeypatch):
    from hf_paged.executor import kv_pool
    from hf_paged.executor.kv_pool import KVPool, LayerKVSpec

    specs = [LayerKVSpec(2, 64, torch.float32)] * 2  # a block is 8 KiB per tensor, 32 KiB in all
    monkeypatch.setattr(kv_pool, "COMMIT_CHUNK_BYTES", 4 * 32 * 1024)
    # 64 MiB per tensor: past any malloc threshold, so the pages come fresh from mmap, none resident yet
    pool = KVPool(specs, num_blocks=8192, block_size=16, device=torch.device("cpu"))
    k1 = pool.kv_caches[1][1]
    if any(_resident_pages(k1[:8])):
        pytest.skip("the allocator handed out memory that was already resident")
    pool.kv_caches[0][0][1].fill_(3.0)  # a block already in use
    pool.commit(2)  # blocks 0-1 handed out: commit a chunk of 4
    assert pool.committed == 4
    assert torch.equal(pool.kv_caches[0][0][1], torch.full_like(pool.kv_caches[0][0][1], 3.0))  # contents kept
    if kv_pool._COMMITTER.ok:  # Linux >= 5.14
        assert all(_resident_pages(k1[:4])) and not any(_resident_pages(k1[4:8]))
    pool.commit(3)
    assert pool.committed == 4  # still inside the chunk: nothing to do
    pool.commit(10)
    assert pool.committed == 10  # past the next chunk's end: up to the high-water mark
    pool.commit(100_000)
    assert pool.committed == 8192  # never past the pool
    meta = KVPool(specs, num_blocks=8, block_size=16, device=torch.device("meta"))
    assert meta.committed == 8  # device memory: nothing to commit


def test_engine_commits_the_pool_through_the_high_water_mark_before_each_step(monkeypatch):
    from hf_paged.executor import kv_pool

    monkeypatch.setattr(kv_pool, "COMMIT_CHUNK_BYTES", 1)  # commit exactly what each step reaches
    model = make_model("llama")
    prompts = make_prompts(5, [40, 3, 17, 33, 9], seed=3)
    with PagedGenerator(model, max_num_seqs=3, block_size=4) as engine:
        seen = []
        execute = engine.executor.runner.execute

        def spy(out):
            seen.append(out.blocks_high_water)
            assert out.blocks_high_water == engine.kv_manager.pool.high_water
            for item in out.scheduled:  # every block the step writes is below the mark, hence committed
                assert max(engine.kv_manager.get_block_ids(item.seq_id)) < out.blocks_high_water
            result = execute(out)
            assert engine.pool.committed == max(seen)
            return result

        monkeypatch.setattr(engine.executor.runner, "execute", spy)
        outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert seen == sorted(seen) and seen[-1] > seen[0]
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == stock_greedy(model, prompt, NEW)
