"""PagedGenerator end to end on tiny random models: exact greedy parity with stock generate, and the API."""

import threading

import pytest
import torch

import hf_paged
from hf_paged import PagedGenerator, SamplingParams
from tests.helpers import make_model, make_prompts, stock_greedy

PARITY_LENGTHS = [1, 2, 5, 17, 33, 64, 100, 150, 200, 255, 300, 7, 40, 90]
NEW_TOKENS = 40
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)

_reference_cache: dict = {}


def reference(arch: str) -> tuple[list[list[int]], list[list[int]]]:
    if arch not in _reference_cache:
        model = make_model(arch)
        prompts = make_prompts(len(PARITY_LENGTHS), PARITY_LENGTHS)
        _reference_cache[arch] = (prompts, [stock_greedy(model, p, NEW_TOKENS) for p in prompts])
    return _reference_cache[arch]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize(
    "block_size,engine_kw",
    [
        (1, dict(num_blocks=8000, max_num_batched_tokens=4096)),  # whole prompts in one step
        (4, dict(num_blocks=2000, max_num_batched_tokens=97)),  # chunked prefill mixed with decodes
        # pool small enough to preempt (no prefill pacing: the prompts enter while others decode and crowd it)
        (16, dict(num_blocks=40, max_num_batched_tokens=128, max_itl_ratio=None)),
    ],
)
def test_greedy_parity_with_stock_generate(arch, block_size, engine_kw):
    prompts, want = reference(arch)
    engine = PagedGenerator(make_model(arch), block_size=block_size, **engine_kw)
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    got = [o.token_ids for o in outs]
    assert got == want
    assert all(o.finish_reason == "length" for o in outs)
    if engine_kw["max_num_batched_tokens"] < max(PARITY_LENGTHS):
        assert engine.num_steps > NEW_TOKENS + 2  # prompts really were chunked
    if engine_kw["num_blocks"] == 40:
        assert sum(engine.scheduler.num_preemptions.values()) > 0
    engine.kv_manager.check_consistency()
    assert engine.kv_manager.num_free_blocks == engine_kw["num_blocks"]
    engine.close()


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_parity_per_attention_backend(arch, backend):
    prompts, want = reference(arch)
    engine = PagedGenerator(make_model(arch), block_size=8, num_blocks=1500, max_num_batched_tokens=64,
                            attention_backend=backend)
    assert engine.backend == backend
    assert [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == want
    engine.close()


def test_sliding_window_matters_in_the_mistral_case():
    """Guard for the parity test above: with a full window the long prompts would decode differently."""
    prompts, want = reference("mistral")
    full = make_model("mistral", sliding_window=None)
    long_ids = [i for i, p in enumerate(prompts) if len(p) > 48]
    assert any(stock_greedy(full, prompts[i], NEW_TOKENS) != want[i] for i in long_ids)


def test_stops_at_eos_like_stock():
    model = make_model("llama")
    prompts = make_prompts(6, [3, 9, 27, 50, 1, 12], seed=5)
    free_run = [stock_greedy(model, p, 30) for p in prompts]
    eos = free_run[2][4]  # a token that really gets generated
    want = [stock_greedy(model, p, 30, eos_token_id=eos) for p in prompts]
    model.generation_config.eos_token_id = eos
    try:
        engine = PagedGenerator(model, num_blocks=256, block_size=8)
        outs = engine.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0), use_tqdm=False)
    finally:
        model.generation_config.eos_token_id = None
    for o, w in zip(outs, want):
        w = w[: w.index(eos) + 1] if eos in w else w
        assert o.token_ids == w
        assert o.finish_reason == ("stop" if o.token_ids[-1] == eos else "length")
    assert any(o.finish_reason == "stop" for o in outs)
    engine.close()


def test_plain_forward_unchanged_while_engine_attached():
    model = make_model("mistral")
    x = torch.tensor([make_prompts(1, [80])[0]])
    with torch.no_grad():
        before = model(x).logits
    engine = PagedGenerator(model, num_blocks=64)
    assert model.config._attn_implementation == "hf_paged"
    with torch.no_grad():
        during = model(x).logits
    engine.close()
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(before, during)


def test_seeded_sampling_independent_of_batch():
    model = make_model("llama")
    prompts = make_prompts(5, [4, 30, 8, 60, 2], seed=1)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    engine = PagedGenerator(model, num_blocks=512)
    alone = engine.generate([prompts[0]], params, use_tqdm=False)[0].token_ids
    mixed_params = [params] + [SamplingParams(max_tokens=20, temperature=1.0) for _ in prompts[1:]]
    together = engine.generate(prompts, mixed_params, use_tqdm=False)[0].token_ids
    again = engine.generate(prompts[::-1], mixed_params[::-1], use_tqdm=False)[-1].token_ids
    other_seed = engine.generate([prompts[0]], params.clone(seed=99), use_tqdm=False)[0].token_ids
    assert alone == together == again
    assert other_seed != alone
    engine.close()


def test_sampling_params_per_prompt_and_greedy_mixed_with_sampled():
    model = make_model("qwen2")
    prompts, want = reference("qwen2")
    engine = PagedGenerator(model, num_blocks=2000)
    params = [GREEDY if i % 2 == 0 else SamplingParams(max_tokens=5, temperature=1.5) for i in range(len(prompts))]
    outs = engine.generate(prompts, params, use_tqdm=False)
    for i, o in enumerate(outs):
        if i % 2 == 0:
            assert o.token_ids == want[i]
        else:
            assert len(o.token_ids) == 5
    engine.close()


def test_min_tokens_blocks_stop_tokens():
    model = make_model("llama")
    prompt = make_prompts(1, [10], seed=2)[0]
    free = stock_greedy(model, prompt, 10)
    engine = PagedGenerator(model, num_blocks=64)
    stop = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[free[0]])
    assert engine.generate([prompt], stop, use_tqdm=False)[0].token_ids == free[:1]
    out = engine.generate([prompt], stop.clone(min_tokens=3), use_tqdm=False)[0]
    assert free[0] not in out.token_ids[:3] and len(out.token_ids) >= 3
    engine.close()


def test_request_output_fields_and_input_order():
    model = make_model("llama")
    engine = PagedGenerator(model, num_blocks=128)
    prompts = make_prompts(3, [50, 2, 20])
    outs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in (3, 9, 5)], use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 9, 5]
    assert [o.prompt_token_ids for o in outs] == prompts
    for o in outs:
        assert o.finished and o.text is None  # no tokenizer
        assert o.arrival_time <= o.first_token_time <= o.finish_time
    single = engine.generate(prompts[1], SamplingParams(max_tokens=9, temperature=0), use_tqdm=False)
    assert single[0].token_ids == outs[1].token_ids  # a flat list of ints is one prompt
    engine.close()


def test_low_level_add_step_abort():
    model = make_model("llama")
    engine = PagedGenerator(model, num_blocks=128)
    a = engine.add_request(make_prompts(1, [5])[0], SamplingParams(max_tokens=50, temperature=0), request_id="a")
    b = engine.add_request(make_prompts(1, [7])[0], SamplingParams(max_tokens=3, temperature=0))
    seen = {}
    for _ in range(2):
        for o in engine.step():
            seen[o.request_id] = o
    assert set(seen) == {"a", b} and len(seen["a"].token_ids) == 2
    assert engine.abort("a") and not engine.abort("a")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_manager.num_free_blocks == 128
    engine.close()


def test_stream_yields_deltas_that_add_up():
    model = make_model("llama")
    engine = PagedGenerator(model, num_blocks=128)
    prompt = make_prompts(1, [12])[0]
    want = stock_greedy(model, prompt, 15)
    deltas = list(engine.stream(prompt, SamplingParams(max_tokens=15, temperature=0)))
    assert [t for d in deltas for t in d.token_ids] == want
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    # closing a stream early aborts its request and frees its blocks
    it = engine.stream(prompt, SamplingParams(max_tokens=15, temperature=0))
    next(it)
    it.close()
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == 128
    engine.close()


def test_concurrent_adds_from_threads():
    model = make_model("llama")
    engine = PagedGenerator(model, num_blocks=256)
    prompts = make_prompts(8, seed=4)
    ids = []

    def add(p):
        ids.append(engine.add_request(p, SamplingParams(max_tokens=4, temperature=0)))

    threads = [threading.Thread(target=add, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 8
    done = set()
    while engine.has_unfinished_requests():
        done |= {o.request_id for o in engine.step() if o.finished}
    assert done == set(ids)
    engine.close()


# -- bad input ---------------------------------------------------------------------------------------------


@pytest.fixture
def busy_engine():
    """An engine with one request mid-flight, to check bad input never disturbs it."""
    model = make_model("llama")
    engine = PagedGenerator(model, num_blocks=64, block_size=4, max_model_len=200)
    prompt = make_prompts(1, [9], seed=8)[0]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0))
    engine.step()
    yield engine, rid, stock_greedy(model, prompt, 20)
    engine.close()


@pytest.mark.parametrize(
    "prompt,params,exc,match",
    [
        ([], None, ValueError, "empty"),
        ("hello", None, ValueError, "tokenizer"),
        ([1] * 201, None, ValueError, "max_model_len"),
        ([5, 512], None, ValueError, r"outside the vocabulary \[0, 512\)"),
        ([5, -1], None, ValueError, "outside the vocabulary"),
        ([5, 2.5], None, TypeError, "ints"),
        ([1, 2], {"max_tokens": 3}, TypeError, "SamplingParams"),
        (3.0, None, TypeError, "prompt"),
    ],
)
def test_bad_requests_raise_and_leave_others_alone(busy_engine, prompt, params, exc, match):
    engine, rid, want = busy_engine
    free_before = engine.kv_manager.num_free_blocks
    with pytest.raises(exc, match=match):
        engine.add_request(prompt, params)
    with pytest.raises(exc, match=match):
        engine.generate([[1, 2, 3], prompt], params, use_tqdm=False)  # validated before any work starts
    assert engine.kv_manager.num_free_blocks == free_before
    assert list(engine.outputs.requests) == [rid] and engine.scheduler.num_unfinished == 1
    tokens = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens = o.token_ids
    assert tokens == want


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(max_tokens=0), ValueError, "max_tokens must be >= 1, got 0"),
        (dict(max_tokens=2.0), TypeError, "max_tokens must be an int"),
        (dict(temperature=-0.5), ValueError, "temperature must be >= 0"),
        (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_k=-1), ValueError, "top_k must be >= 0, got -1"),
        (dict(min_p=2.0), ValueError, "min_p"),
        (dict(seed=-3), ValueError, "seed"),
        (dict(stop_token_ids=[1, "x"]), TypeError, "stop_token_ids"),
        (dict(min_tokens=5, max_tokens=2), ValueError, "min_tokens"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
    ],
)
def test_sampling_params_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_engine_config_validation():
    model = make_model("llama")
    with pytest.raises(TypeError, match="unknown engine config key.*'blocksize'"):
        PagedGenerator(model, blocksize=16)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        PagedGenerator(model, block_size=12)
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        PagedGenerator(model, num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        PagedGenerator(model, num_blocks=4000, max_model_len=5000)
    with pytest.raises(ValueError, match="attention_backend"):
        PagedGenerator(model, attention_backend="cuda")
    assert model.config._attn_implementation == "sdpa"  # failed constructions leave the model alone


def test_model_without_attention_interface_is_rejected():
    model = make_model("llama")

    class Legacy(type(model)):
        _supports_attention_backend = False

    legacy = Legacy(model.config)
    with pytest.raises(NotImplementedError, match="Legacy does not support"):
        PagedGenerator(legacy)


def test_default_pool_sizing_from_memory():
    model = make_model("llama")
    engine = PagedGenerator(model, max_num_seqs=4)  # 4 sequences of 512 tokens, at least one of 1024
    assert engine.pool.capacity_tokens == 4 * 512
    assert engine.max_model_len == 1024
    engine.close()
    engine = PagedGenerator(model, max_num_seqs=1)
    assert engine.pool.capacity_tokens == 1024  # one full-length sequence always fits
    engine.close()
    engine = PagedGenerator(model, max_num_seqs=128, kv_cache_memory_fraction=1e-9)
    assert engine.pool.num_blocks == 1  # the memory cap wins
    engine.close()
    engine = PagedGenerator(model, kv_cache_memory=2**20, block_size=16)
    per_token = 2 * 2 * 2 * 16 * 4  # layers * (k, v) * kv_heads * head_dim * fp32
    assert engine.pool.num_blocks == 2**20 // (per_token * 16)
    engine.close()


def test_public_api_exports():
    assert hf_paged.PagedGenerator is PagedGenerator and hf_paged.SamplingParams is SamplingParams


def test_token_id_list_reads_every_form_of_a_token_id_setting():
    from hf_paged.engine.engine_setup import token_id_list

    assert token_id_list(None) == []
    assert token_id_list(2) == [2]
    assert token_id_list([2, 5]) == [2, 5]
    assert token_id_list(torch.tensor([[7], [9]])) == [7, 9]
    assert all(type(t) is int for t in token_id_list(torch.tensor([7, 9])))


def test_eos_token_ids_come_from_the_generation_config_then_the_tokenizer():
    from types import SimpleNamespace

    from hf_paged.engine.engine_setup import eos_token_ids

    model = make_model("llama")
    model.generation_config.eos_token_id = [3, torch.tensor(4).item()]
    assert eos_token_ids(model, None) == frozenset({3, 4})
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    assert eos_token_ids(model, SimpleNamespace(eos_token_id=6)) == frozenset({6})
    assert eos_token_ids(model, None) == frozenset()


def test_generate_builds_each_output_once_while_step_reports_every_step(monkeypatch):
    """``generate`` reads only the final outputs: its steps build none before a request finishes (they cost ~5%
    of a 64-request run); a request added with ``add_request`` still gets an output from every ``step``."""
    from hf_paged.engine.output_processor import OutputProcessor

    model = make_model("llama", seed=21)
    prompts = make_prompts(3, lengths=[4, 9, 6], seed=2)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    built = []
    real = OutputProcessor.output
    monkeypatch.setattr(OutputProcessor, "output", lambda self, state: built.append(state.request_id) or real(self, state))
    with PagedGenerator(model, num_blocks=32, max_num_seqs=3) as engine:
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [stock_greedy(model, p, 8) for p in prompts]
        assert len(built) == 2 * len(prompts)  # once when each finished, once for the returned list
        built.clear()
        engine.add_request(prompts[0], params, request_id="r")
        steps = 0
        while engine.has_unfinished_requests():
            assert [o.request_id for o in engine.step()] == ["r"]
            steps += 1
        assert built.count("r") == steps
