"""Bad input everywhere: a clear exception naming the field and its value, and nothing else disturbed.

Every case runs against one wrapped engine with two requests in flight; after the bad input those two
finish with exactly the tokens they get without it, and every block is back.
"""

import json
import math

import numpy as np
import pytest
import torch

import hf_paged
from hf_paged import BeamSearchParams, EngineConfig, PagedGenerator, SamplingParams
from hf_paged.cli import main as cli_main
from tests.helpers import make_model, make_prompts, stock_greedy

P = SamplingParams
RUNNING = make_prompts(2, [6, 23], seed=31)
NEW = 8


@pytest.fixture(scope="module")
def wrapped():
    model = make_model("llama", seed=4)
    want = [stock_greedy(model, p, NEW) for p in RUNNING]
    hf_paged.wrap(model, num_blocks=200, block_size=4, max_model_len=256, max_num_seqs=8)
    yield model, want
    hf_paged.unwrap(model)


def sp(**kw):
    return lambda m: P(**kw)


def cfg(**kw):
    return lambda m: PagedGenerator(m, **kw)


def add(*args, **kw):
    return lambda m: m.paged.add_request(*args, **kw)


def gen(**kw):
    ids = torch.tensor([[5, 6, 7]])
    return lambda m: m.generate(ids, **{"max_new_tokens": 3, "pad_token_id": 0, **kw})


def cli(*argv):
    def run(m):
        code = cli_main(list(argv))
        assert code == 2
        raise SystemExit(2)

    return run


CASES = [
    # SamplingParams
    ("max_tokens=0", sp(max_tokens=0), ValueError, r"max_tokens must be >= 1, got 0"),
    ("max_tokens<0", sp(max_tokens=-5), ValueError, r"max_tokens must be >= 1, got -5"),
    ("max_tokens float", sp(max_tokens=2.5), TypeError, r"max_tokens must be an int, got 2.5"),
    ("max_tokens str", sp(max_tokens="8"), TypeError, r"max_tokens must be an int, got '8'"),
    ("max_tokens bool", sp(max_tokens=True), TypeError, r"max_tokens must be an int, got True"),
    ("temperature<0", sp(temperature=-0.5), ValueError, r"temperature must be >= 0.*got -0.5"),
    ("temperature nan", sp(temperature=math.nan), ValueError, r"temperature must be a finite number, got nan"),
    ("temperature inf", sp(temperature=math.inf), ValueError, r"temperature must be >= 0.*finite, got inf"),
    ("temperature str", sp(temperature="hot"), TypeError, r"temperature must be a number, got 'hot'"),
    ("top_k<0", sp(top_k=-1), ValueError, r"top_k must be >= 0, got -1"),
    ("top_k float", sp(top_k=3.5), TypeError, r"top_k must be an int, got 3.5"),
    ("top_p=0", sp(top_p=0), ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    ("top_p>1", sp(top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1.5"),
    ("top_p nan", sp(top_p=math.nan), ValueError, r"top_p must be a finite number, got nan"),
    ("top_p<0", sp(top_p=-0.1), ValueError, r"top_p must be in \(0, 1\], got -0.1"),
    ("min_p<0", sp(min_p=-0.1), ValueError, r"min_p must be in \[0, 1\], got -0.1"),
    ("min_p>1", sp(min_p=1.5), ValueError, r"min_p must be in \[0, 1\], got 1.5"),
    ("seed<0", sp(seed=-1), ValueError, r"seed must be in \[0, 18446744073709551615\], got -1"),
    ("seed too big", sp(seed=2**70), ValueError, r"seed must be in \[0, 18446744073709551615\], got 1180591620717411303424"),
    ("seed float", sp(seed=1.5), TypeError, r"seed must be an int, got 1.5"),
    ("seed+n too big", sp(seed=2**64 - 1, n=2), ValueError, r"seed \+ n - 1 must be <= .*seed=18446744073709551615, n=2"),
    ("stop_token_ids str", sp(stop_token_ids="abc"), TypeError, r"stop_token_ids must be a list of ints, got 'abc'"),
    ("stop_token_ids<0", sp(stop_token_ids=[-1]), ValueError, r"stop_token_ids entry must be >= 0, got -1"),
    ("stop_token_ids float", sp(stop_token_ids=[1.5]), TypeError, r"stop_token_ids entry must be an int, got 1.5"),
    ("stop_token_ids int", sp(stop_token_ids=5), TypeError, r"stop_token_ids must be a list of ints, got 5"),
    ("ignore_eos str", sp(ignore_eos="yes"), TypeError, r"ignore_eos must be a bool, got 'yes'"),
    ("min_tokens<0", sp(min_tokens=-1), ValueError, r"min_tokens must be in \[0, 16\], got -1"),
    ("min_tokens>max", sp(min_tokens=20, max_tokens=8), ValueError, r"min_tokens must be in \[0, 8\], got 20"),
    ("repetition_penalty=0", sp(repetition_penalty=0), ValueError, r"repetition_penalty must be > 0 and finite in float32 .*got 0.0"),
    ("repetition_penalty<0", sp(repetition_penalty=-1), ValueError, r"repetition_penalty must be > 0 and finite in float32 .*got -1.0"),
    ("repetition_penalty inf", sp(repetition_penalty=math.inf), ValueError, r"repetition_penalty must be > 0 and finite in float32 .*got inf"),
    # found by the schema fuzz: 0 in float32, so a grammar-masked logit became -inf * 0 = NaN
    ("repetition_penalty 5e-102", sp(repetition_penalty=5e-102), ValueError, r"repetition_penalty must be > 0 and finite in float32 \(from 1.175e-38 .*got 5e-102"),
    ("repetition_penalty nan", sp(repetition_penalty=math.nan), ValueError, r"repetition_penalty must be a finite number, got nan"),
    ("stop int", sp(stop=5), TypeError, r"stop must be a string or a list of strings, got 5"),
    ("stop empty", sp(stop=[""]), ValueError, r"stop strings must be non-empty str, got ''"),
    ("stop non-str", sp(stop=[3]), ValueError, r"stop strings must be non-empty str, got 3"),
    ("n=0", sp(n=0), ValueError, r"n must be >= 1, got 0"),
    ("n float", sp(n=2.0), TypeError, r"n must be an int, got 2.0"),
    ("logprobs<0", sp(logprobs=-1), ValueError, r"logprobs must be >= 0, got -1"),
    ("logprobs str", sp(logprobs="5"), TypeError, r"logprobs must be an int, got '5'"),
    ("beam_width=0", lambda m: BeamSearchParams(beam_width=0), ValueError, r"beam_width must be >= 1, got 0"),
    ("beam sampling field", lambda m: BeamSearchParams(temperature=0.5), TypeError, r"unexpected keyword argument 'temperature'"),
    # EngineConfig (a failed constructor leaves the model and its engine as they were)
    ("block_size=3", cfg(block_size=3), ValueError, r"block_size must be a power of two, got 3"),
    ("block_size=0", cfg(block_size=0), ValueError, r"block_size must be >= 1, got 0"),
    ("block_size str", cfg(block_size="16"), TypeError, r"block_size must be an int, got '16'"),
    ("num_blocks=0", cfg(num_blocks=0), ValueError, r"num_blocks must be >= 1, got 0"),
    ("max_num_seqs=0", cfg(max_num_seqs=0), ValueError, r"max_num_seqs must be >= 1, got 0"),
    ("budget=0", cfg(max_num_batched_tokens=0), ValueError, r"max_num_batched_tokens must be >= 1, got 0"),
    ("fraction=0", cfg(kv_cache_memory_fraction=0), ValueError, r"kv_cache_memory_fraction must be in \(0, 1\], got 0"),
    ("fraction>1", cfg(kv_cache_memory_fraction=1.5), ValueError, r"kv_cache_memory_fraction must be in \(0, 1\], got 1.5"),
    ("backend", cfg(attention_backend="gpu"), ValueError, r"attention_backend must be one of .*, got 'gpu'"),
    ("prepack", cfg(prepack_weights="fast"), ValueError, r"prepack_weights must be None, True, False, .*got 'fast'"),
    ("chunked str", cfg(enable_chunked_prefill="yes"), TypeError, r"enable_chunked_prefill must be a bool, got 'yes'"),
    ("prefix caching int", cfg(enable_prefix_caching=1), TypeError, r"enable_prefix_caching must be a bool, got 1"),
    ("unknown key", cfg(blocksize=16), TypeError, r"unknown engine config key\(s\) \['blocksize'\]"),
    ("swap_space<0", cfg(swap_space=-1), ValueError, r"swap_space must be >= 0, got -1"),
    ("preemption_mode", cfg(preemption_mode="evict"), ValueError, r"preemption_mode must be one of .*, got 'evict'"),
    ("policy", cfg(scheduling_policy="lifo"), ValueError, r"scheduling_policy must be one of .*, got 'lifo'"),
    ("max_model_len=0", cfg(max_model_len=0), ValueError, r"max_model_len must be >= 1, got 0"),
    ("max_model_len huge", cfg(max_model_len=10**6), ValueError, r"max_model_len=1000000 exceeds"),
    ("seed<0 engine", cfg(seed=-1), ValueError, r"seed must be >= 0, got -1"),
    ("num_blocks float", cfg(num_blocks=2.5), TypeError, r"num_blocks must be an int, got 2.5"),
    # PagedGenerator intake
    ("empty prompt", add([]), ValueError, r"prompt \[\] is empty"),
    ("text without tokenizer", add("hello"), ValueError, r"a text prompt \('hello'\) needs a tokenizer"),
    ("token >= vocab", add([5, 512]), ValueError, r"token id 512 is outside the vocabulary \[0, 512\)"),
    ("token < 0", add([5, -1]), ValueError, r"token id -1 is outside the vocabulary \[0, 512\)"),
    ("token float", add([5, 2.5]), TypeError, r"token ids must be ints, got 2.5"),
    ("prompt float", add(3.0), TypeError,
     r"prompt must be a str, a list of token ids, or a 1-D integer tensor or NumPy array, got float"),
    ("prompt bytes", add(b"hi"), TypeError, r"prompt must be a str, .*got bytes \(b'hi'\): decode it to a str"),
    ("prompt bytearray", add(bytearray(b"hi")), TypeError, r"got bytearray"),
    ("generate bytes", lambda m: m.paged.generate(b"hi", use_tqdm=False), TypeError,
     r"prompts must be .*got bytes \(b'hi'\): decode it to a str"),
    ("generate bytes in a list", lambda m: m.paged.generate([[1, 2], b"hi"], use_tqdm=False), TypeError, r"got bytes"),
    ("stream bytes", lambda m: next(m.paged.stream(b"hi")), TypeError, r"got bytes"),
    ("beam bytes", lambda m: m.paged.beam_search(b"hi"), TypeError, r"got bytes"),
    ("prompt 2-D array", add(np.zeros((2, 2), dtype=np.int64)), TypeError,
     r"an array prompt must be 1-D integer token ids, got int64 \(2, 2\)"),
    ("generate 2-D array", lambda m: m.paged.generate(np.zeros((2, 2), dtype=np.int64), use_tqdm=False), TypeError,
     r"an array prompt must be 1-D integer token ids, got int64 \(2, 2\)"),
    ("prompt float array", add(np.array([1.0, 2.0])), TypeError, r"an array prompt must hold integer token ids, got dtype float64"),
    ("params dict", add([1, 2], {"max_tokens": 3}), TypeError, r"sampling_params must be a SamplingParams, got dict"),
    ("prompt 2-D tensor", add(torch.zeros(2, 2, dtype=torch.long)), TypeError, r"1-D integer token ids, got torch.int64 \(2, 2\)"),
    ("prompt too long", add([1] * 300), ValueError, r"prompt has 300 tokens, more than max_model_len=256"),
    ("request_id int", add([1, 2], request_id=5), TypeError, r"request_id must be a str, got 5"),
    ("request_id empty", add([1, 2], request_id=""), ValueError, r"request_id must be a non-empty str, got ''"),
    ("stream request_id empty", lambda m: next(m.paged.stream([1, 2], request_id="")), ValueError,
     r"request_id must be a non-empty str"),
    ("max_tokens past the context", add([1] * 250, P(max_tokens=10)), ValueError,
     r"max_tokens=10 is too large: the prompt has 250 tokens and max_model_len is 256, so at most 6 new tokens fit"),
    ("max_tokens past the context, one of many", lambda m: m.paged.generate([[1, 2], [1] * 250], P(max_tokens=7),
     use_tqdm=False), ValueError, r"max_tokens=7 is too large: the prompt has 250 tokens .*at most 6 new tokens fit"),
    ("stream max_tokens past the context", lambda m: next(m.paged.stream([1] * 200, P(max_tokens=100))), ValueError,
     r"max_tokens=100 is too large: the prompt has 200 tokens and max_model_len is 256, so at most 56"),
    ("request_id in use", add([1, 2], request_id="running-0"), ValueError, r"request id 'running-0' is already in use"),
    ("priority str", add([1, 2], priority="1"), TypeError, r"priority must be an int, got '1'"),
    ("stop without tokenizer", add([1, 2], P(stop=["x"])), ValueError, r"stop strings \['x'\] need a tokenizer"),
    ("stop id >= vocab", add([1, 2], P(stop_token_ids=[600])), ValueError, r"stop_token_ids \[600\] are outside the vocabulary"),
    ("n > max_num_seqs", add([1, 2], P(n=1000)), ValueError, r"n=1000 samples exceed max_num_seqs=8"),
    ("generate empty", lambda m: m.paged.generate([[1, 2], []], use_tqdm=False), ValueError, r"prompt \[\] is empty"),
    ("generate params count", lambda m: m.paged.generate([[1], [2]], [P()], use_tqdm=False), ValueError,
     r"got 1 sampling params for 2 prompts"),
    ("stream empty", lambda m: next(m.paged.stream([])), ValueError, r"prompt \[\] is empty"),
    ("beam too long", lambda m: m.paged.beam_search([[1] * 250], BeamSearchParams(max_tokens=10)), ValueError,
     r"beam search of 10 tokens after a 250-token prompt exceeds max_model_len=256"),
    ("beam params type", lambda m: m.paged.beam_search([[1, 2]], "beams"), TypeError,
     r"params must be a BeamSearchParams, got str"),
    # wrapped generate and pipeline
    ("mask shape", gen(attention_mask=torch.ones(1, 2, dtype=torch.long)), ValueError,
     r"attention_mask shape \(1, 2\) does not match input_ids \(1, 3\)"),
    ("num_return_sequences huge", gen(do_sample=True, num_return_sequences=10**6), ValueError,
     r"n=1000000 samples exceed max_num_seqs=8"),
    ("stop_strings without tokenizer", gen(stop_strings=["x"]), ValueError, r"stop_strings=\['x'\] need a tokenizer"),
    ("pipeline without tokenizer", lambda m: hf_paged.pipeline(m), ValueError,
     r"hf_paged.pipeline needs a tokenizer .*LlamaForCausalLM.*tokenizer=None"),
    # the command line (one line on stderr, exit code 2, before any model is loaded)
    ("cli top-p", cli("generate", "hi", "--top-p", "1.5"), SystemExit, r"--top-p must be in \(0, 1\], got 1.5"),
    ("cli max-tokens", cli("generate", "hi", "--max-tokens", "0"), SystemExit, r"--max-tokens must be >= 1, got 0"),
    ("cli temperature", cli("batch", "x.jsonl", "--temperature", "-1"), SystemExit, r"--temperature must be >= 0.*got -1.0"),
    ("cli missing file", cli("batch", "/nonexistent/chat.jsonl"), SystemExit, r"'/nonexistent/chat.jsonl': no such file"),
    ("cli missing model", cli("generate", "hi", "--model", "/nonexistent/model"), SystemExit,
     r"--model '/nonexistent/model': no such folder"),
    ("cli repeat", cli("bench", "chat", "--repeat", "0"), SystemExit, r"argument --repeat: must be >= 1, got 0"),
    ("cli dtype", cli("generate", "hi", "--dtype", "int8"), SystemExit, r"argument --dtype: invalid choice: 'int8'"),
]


def test_the_table_is_big_enough():
    assert len(CASES) >= 60
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,call,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_and_running_requests_are_unaffected(wrapped, capsys, name, call, exc, match):
    model, want = wrapped
    engine = model.paged
    greedy = P(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, greedy, request_id=f"running-{i}") for i, p in enumerate(RUNNING)]
    engine.step()
    if exc is SystemExit:
        with pytest.raises(SystemExit):
            call(model)
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("hf-paged: error: "), err
        import re

        assert re.search(match, err), err
    else:
        with pytest.raises(exc, match=match):
            call(model)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = out.token_ids
    assert [got[i] for i in ids] == want
    assert engine.kv_manager.num_used_blocks == 0
    engine.kv_manager.check_consistency()
    assert model.config._attn_implementation == "hf_paged"


def test_cli_batch_rejects_a_malformed_file_before_loading(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n{not json\n")
    assert cli_main(["batch", str(bad)]) == 2
    assert f"{bad}:2: expected a JSON object with a 'messages' list" in capsys.readouterr().err


def test_engine_config_repr_is_a_dataclass():
    assert EngineConfig().preemption_mode == "auto"


# -- extreme values: rejected at construction, or valid tokens; a step never raises -------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXTREME_INTS = st.one_of(
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**64 - 1, 2**64, 2**70, -(2**70), 10**30]), st.integers(-5, 600)
)
EXTREME_FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 1e-300, 1e-44, 5e-324, 1e-6, 1e-5, 1.0, 1e300, -1e300, math.inf, -math.inf, math.nan]),
    st.floats(allow_nan=True, allow_infinity=True),
)
WRONG_TYPES = st.sampled_from([None, "1", [1], True, b"x", 1j])


def field(values):
    return st.one_of(values, WRONG_TYPES)


@pytest.fixture(scope="module")
def extreme_engine():
    """One engine for every example, closed after this module: left open on the cached model, it once leaked its
    patched forwards into a later test's deepcopy of that model."""
    engine = PagedGenerator(make_model("llama", seed=9), num_blocks=300, block_size=4, max_model_len=256)
    yield engine
    engine.close()


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(
    max_tokens=field(EXTREME_INTS), temperature=field(EXTREME_FLOATS), top_k=field(EXTREME_INTS),
    top_p=field(EXTREME_FLOATS), min_p=field(EXTREME_FLOATS), seed=st.one_of(st.none(), EXTREME_INTS),
    repetition_penalty=field(EXTREME_FLOATS), n=field(st.integers(-2, 4)),
)
def test_extreme_sampling_params_are_rejected_or_sample_valid_tokens(
    extreme_engine, max_tokens, temperature, top_k, top_p, min_p, seed, repetition_penalty, n
):
    kw = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
              repetition_penalty=repetition_penalty, n=n, ignore_eos=True)
    try:
        params = SamplingParams(**kw)
    except (ValueError, TypeError):
        return  # rejected before any work
    engine = extreme_engine
    rid = engine.add_request([5, 6, 7, 8], params)
    for _ in range(3):
        outs = engine.step()  # never raises
        for out in outs:
            for c in out.outputs:
                assert c.finish_reason != "error", c.error
                assert all(0 <= t < 512 for t in c.token_ids)
    engine.abort(rid)
    engine.step()
    assert engine.kv_manager.num_used_blocks == 0




# -- fault injection: each failure fails only what it must -----------------------------------------------


@pytest.fixture
def engine():
    e = PagedGenerator(make_model("llama", seed=5), num_blocks=200, block_size=4)
    yield e
    e.close()


def drain(engine) -> dict:
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = out
    return got


def test_an_exception_in_the_forward_fails_only_that_steps_requests(engine, monkeypatch):
    prompts = make_prompts(3, [5, 9, 14], seed=41)
    model = engine.model
    want = stock_greedy(model, prompts[2], 6)
    greedy = P(max_tokens=6, temperature=0.0, ignore_eos=True)
    a = engine.add_request(prompts[0], greedy)
    b = engine.add_request(prompts[1], greedy)
    engine.step()
    engine.step()  # a and b hold two tokens each
    original = engine.executor.runner.compute_logits
    calls = {"n": 0}

    def flaky(inputs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device failure")
        return original(inputs)

    monkeypatch.setattr(engine.executor.runner, "compute_logits", flaky)
    failed = {o.request_id: o for o in engine.step()}
    assert set(failed) == {a, b}
    for out in failed.values():
        assert out.finish_reason == "error" and "simulated device failure" in out.outputs[0].error
        assert len(out.token_ids) == 2  # tokens produced before the failure are kept
    assert engine.kv_manager.num_used_blocks == 0
    c = engine.add_request(prompts[2], greedy)  # the engine goes on
    assert drain(engine)[c].token_ids == want


def test_an_exception_while_sampling_one_request_fails_only_that_request(engine, monkeypatch):
    from hf_paged.sample.sampling import SeqState

    prompts = make_prompts(2, [5, 9], seed=42)
    want = stock_greedy(engine.model, prompts[1], 6)
    bad = engine.add_request(prompts[0], P(max_tokens=6, temperature=1.0, seed=123, ignore_eos=True))
    good = engine.add_request(prompts[1], P(max_tokens=6, temperature=0.0, ignore_eos=True))
    original = SeqState.get_generator

    def broken(self, device):
        if self.params.seed == 123:
            raise OverflowError("Overflow when unpacking long long")
        return original(self, device)

    monkeypatch.setattr(SeqState, "get_generator", broken)
    got = drain(engine)
    assert got[bad].finish_reason == "error" and "Overflow when unpacking long long" in got[bad].outputs[0].error
    assert got[good].token_ids == want and got[good].finish_reason == "length"
    assert engine.kv_manager.num_used_blocks == 0


def test_non_finite_logits_fail_their_request_with_a_clear_message(engine, monkeypatch):
    prompts = make_prompts(2, [5, 9], seed=43)
    original = engine.executor.runner.compute_logits
    target = {}

    def poisoned(inputs):
        logits = original(inputs)
        for row, item in enumerate(inputs.sampled):
            if item.seq_id == target.get("seq"):
                logits[row, 7] = float("nan")
        return logits

    monkeypatch.setattr(engine.executor.runner, "compute_logits", poisoned)
    a = engine.add_request(prompts[0], P(max_tokens=4, temperature=0.7, ignore_eos=True))
    b = engine.add_request(prompts[1], P(max_tokens=4, temperature=0.0, ignore_eos=True))
    target["seq"] = engine.outputs.state_of(a).first.seq_id
    got = drain(engine)
    assert got[a].finish_reason == "error" and "non-finite (NaN or inf) logits" in got[a].outputs[0].error
    assert got[b].finish_reason == "length" and len(got[b].token_ids) == 4


def test_an_exception_in_a_stop_string_check_fails_only_that_request(engine, monkeypatch):
    from hf_paged.model.default_model import load_default

    model, tok = load_default()
    e = PagedGenerator(model, tok, max_num_seqs=4)
    try:
        a = e.add_request("Count to ten:", P(max_tokens=6, temperature=0.0, stop=["zzz"]))
        b = e.add_request("Say hi.", P(max_tokens=6, temperature=0.0))
        checker = e.outputs.state_of(a).stop_checkers[0]
        monkeypatch.setattr(checker, "update", lambda ids: (_ for _ in ()).throw(UnicodeDecodeError("utf-8", b"", 0, 1, "bad")))
        got = drain(e)
        assert got[a].finish_reason == "error" and "stop string check failed" in got[a].outputs[0].error
        assert got[b].finish_reason in ("stop", "length") and got[b].token_ids
        assert e.kv_manager.num_used_blocks == 0
    finally:
        e.close()


def test_an_exception_in_a_streamer_stops_that_call_only(monkeypatch):
    from transformers.generation.streamers import BaseStreamer

    model = make_model("llama", seed=6)
    prompts = make_prompts(2, [5, 9], seed=44)
    want = stock_greedy(model, prompts[1], 6)
    hf_paged.wrap(model, num_blocks=200, block_size=4)
    try:
        other = model.paged.add_request(prompts[1], P(max_tokens=6, temperature=0.0, ignore_eos=True))

        class Broken(BaseStreamer):
            def __init__(self):
                self.puts = 0

            def put(self, value):
                self.puts += 1
                if self.puts == 3:
                    raise RuntimeError("the client went away")

            def end(self):
                pass

        with pytest.raises(RuntimeError, match="the client went away"):
            model.generate(torch.tensor([prompts[0]]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                           streamer=Broken())
        got = drain(model.paged)
        assert got[other].token_ids == want
        assert model.paged.kv_manager.num_used_blocks == 0
    finally:
        hf_paged.unwrap(model)


def test_an_abort_output_survives_a_step_that_raises(engine, monkeypatch):
    rid = engine.add_request([1, 2, 3], P(max_tokens=4))
    engine.step()
    engine.abort(rid)
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    monkeypatch.undo()
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "abort")]


def test_a_stream_aborted_from_outside_ends_with_an_abort_item(engine):
    stream = engine.stream([1, 2, 3], P(max_tokens=50, temperature=0.0, ignore_eos=True), request_id="s")
    first = next(stream)
    assert first.token_ids and not first.finished
    assert engine.abort("s")
    rest = list(stream)
    assert rest and rest[-1].finish_reason == "abort" and rest[-1].finished


def test_numpy_and_torch_integer_token_ids_are_accepted(engine):
    import numpy as np

    prompt = make_prompts(1, [6], seed=45)[0]
    want = stock_greedy(engine.model, prompt, 4)
    params = P(max_tokens=4, temperature=0.0, ignore_eos=True)
    for ids in (np.array(prompt), [np.int64(t) for t in prompt], [torch.tensor(t) for t in prompt], torch.tensor(prompt)):
        assert engine.generate([ids] if not isinstance(ids, list) else [ids], params, use_tqdm=False)[0].token_ids == want


def test_numpy_token_id_arrays_are_accepted_wherever_a_tensor_is(engine):
    prompts = make_prompts(2, [6, 9], seed=46)
    params = P(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in engine.generate([torch.tensor(p) for p in prompts], params, use_tqdm=False)]
    arrays = [np.array(p, dtype=np.int64) for p in prompts]
    assert engine.generate(arrays[0], params, use_tqdm=False)[0].token_ids == want[0]  # one array: one prompt
    assert engine.generate(np.array(prompts[0], dtype=np.uint16), params, use_tqdm=False)[0].token_ids == want[0]
    assert [o.token_ids for o in engine.generate(arrays, params, use_tqdm=False)] == want  # a list: several
    assert [o.token_ids for o in engine.generate(list(arrays[1]), params, use_tqdm=False)] == [want[1]]  # np ints
    rid = engine.add_request(arrays[1], params)
    assert drain(engine)[rid].token_ids == want[1]
    assert sum((d.token_ids for d in engine.stream(arrays[0], params)), []) == want[0]
    beams = BeamSearchParams(beam_width=2, max_tokens=3)
    assert [b.sequences[0].token_ids for b in engine.beam_search(arrays[0], beams)] == [
        b.sequences[0].token_ids for b in engine.beam_search(torch.tensor(prompts[0]), beams)]
    assert len(engine.beam_search(arrays, beams)) == 2


def test_max_tokens_that_just_fit_the_context_run_to_the_end(wrapped):
    model, _ = wrapped
    out = model.paged.generate([[1] * 250], P(max_tokens=6, ignore_eos=True, temperature=0.0), use_tqdm=False)[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_stock_generate_past_the_context_is_still_cut_at_max_model_len(wrapped):
    """HF ``generate`` does not check ``max_new_tokens`` against the context: the wrapped one still stops at
    ``max_model_len`` (the engine's request API refuses it, as the server does)."""
    model, _ = wrapped
    ids = torch.tensor([[7] * 250])
    out = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 256)
    assert model.paged.kv_manager.num_used_blocks == 0
