"""HF logits processors, prefix_allowed_tokens_fn and stopping criteria inside the engine (issue #26 item 3).

Wrapped ``generate``: token-for-token equality with stock ``generate`` (greedy, fp32) on a left-padded batch of
prompts of different lengths, with stock's fallback made to raise, so a pass cannot come from stock. Each case
also differs from the unconstrained output, so the processor really acted. Engine API:
``SamplingParams(logits_processors=..., stopping_criteria=...)`` per request in a continuous batch.
"""

import re
import warnings

import pytest
import torch
from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.logits_process import (
    LogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, StoppingCriteria

import hf_paged
from hf_paged import PagedGenerator, SamplingParams
from hf_paged.hf import generate as generate_mod
from hf_paged.hf.generate import _warned
from tests.helpers import make_model, make_prompts, stock_greedy
from tests.test_hf_generate import padded

PROMPTS = make_prompts(3, [7, 30, 12], seed=11)
NEW = 20


class BanRange(LogitsProcessor):
    """A custom processor that reads input_ids: bans a window of ids that moves with the last token."""

    def __call__(self, input_ids, scores):
        for b in range(input_ids.shape[0]):
            start = int(input_ids[b, -1]) % 400
            scores[b, start : start + 100] = float("-inf")
        return scores


class StopOnMultipleOf7(StoppingCriteria):
    def __call__(self, input_ids, scores):
        return input_ids[:, -1] % 7 == 0


class StopAtLength(StoppingCriteria):
    """MaxLength-like: total (padded) length, as stock's input_ids count it."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores):
        return torch.full((input_ids.shape[0],), input_ids.shape[-1] >= self.length, dtype=torch.bool)


def allowed_tokens(batch_id, sent):
    return list(range(3 + batch_id, 512, 2 + int(sent[-1]) % 3))


CASES = {
    "custom logits processor": dict(logits_processor=LogitsProcessorList([BanRange()])),
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=allowed_tokens),
    "custom stopping criterion": dict(stopping_criteria=StoppingCriteriaList([StopOnMultipleOf7()])),
    "MaxLength-like criterion": dict(stopping_criteria=StoppingCriteriaList([StopAtLength(41)])),
    "MaxLengthCriteria": dict(stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(40)])),
    "sequence_bias": dict(sequence_bias={(5,): 8.0, (7, 9): -5.0}),
    "bad_words_ids": dict(bad_words_ids="from_free"),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=1),
    "suppress_tokens": dict(suppress_tokens="from_free"),
    "begin_suppress_tokens": dict(begin_suppress_tokens="from_free"),
    "forced_eos_token_id": dict(forced_eos_token_id=7, max_new_tokens=9),
    "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(3, 1.6), eos_token_id="from_free"),
    "stacked with penalty and min length": dict(
        no_repeat_ngram_size=2, repetition_penalty=1.3, min_new_tokens=5, eos_token_id="from_free",
        logits_processor=LogitsProcessorList([BanRange()]),
    ),
}


@pytest.fixture
def llama():
    model = make_model("llama")
    yield model
    if hf_paged.hf.is_wrapped(model):
        hf_paged.unwrap(model)


@pytest.fixture
def no_fallback(monkeypatch):
    def refuse(model, reasons, *args, **kwargs):
        raise AssertionError(f"fell back to stock generate: {reasons}")

    monkeypatch.setattr(generate_mod, "_fallback", refuse)


def resolve(kwargs, free, width):
    """Fill the "from_free" values with tokens the unconstrained run really generates (so they matter)."""
    out = dict(kwargs)
    first = [int(t) for t in free[:, width]]
    later = [int(t) for t in free[:, width + 2]]
    fills = {"bad_words_ids": [[later[0]], [later[1]], first[2:3] + later[2:3]], "suppress_tokens": later,
             "begin_suppress_tokens": first, "eos_token_id": [later[1]]}
    for key, value in kwargs.items():
        if value == "from_free":
            out[key] = fills[key]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_wrapped_generate_runs_processors_in_the_engine_like_stock(llama, no_fallback, case):
    ids, mask = padded(PROMPTS)
    base = dict(attention_mask=mask, max_new_tokens=CASES[case].get("max_new_tokens", NEW), do_sample=False, pad_token_id=0)
    free = llama.generate(ids, **base)
    kwargs = resolve({k: v for k, v in CASES[case].items() if k != "max_new_tokens"}, free, ids.shape[1])
    want = llama.generate(ids, **base, **kwargs)
    assert not torch.equal(want, free)  # the processor changes the output, so the check below means something
    hf_paged.wrap(llama, num_blocks=256, block_size=8)
    got = llama.generate(ids, **base, **kwargs)
    assert got.shape == want.shape and torch.equal(got, want)
    llama.paged.kv_manager.check_consistency()
    assert llama.paged.kv_manager.num_free_blocks == 256


def test_processed_scores_match_stock(llama, no_fallback):
    ids, mask = padded(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              output_scores=True, no_repeat_ngram_size=1, logits_processor=LogitsProcessorList([BanRange()]))
    want = llama.generate(ids, **kw)
    hf_paged.wrap(llama, num_blocks=256, block_size=8)
    got = llama.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.scores, want.scores, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_sampling_with_processors_and_several_samples(llama, no_fallback):
    """Sampling cannot match stock's draws; what must hold: the constraints, per-sample state, torch seeding."""
    ids, mask = padded(PROMPTS[:2])
    seen = []

    def allowed(batch_id, sent):
        seen.append((batch_id, sent.shape[-1]))
        return list(range(10 * (batch_id + 1), 10 * (batch_id + 1) + 50))

    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20, num_return_sequences=3, pad_token_id=0,
              prefix_allowed_tokens_fn=allowed, no_repeat_ngram_size=1)
    hf_paged.wrap(llama, num_blocks=256, block_size=8)
    torch.manual_seed(3)
    a = llama.generate(ids, **kw)
    torch.manual_seed(3)
    b = llama.generate(ids, **kw)
    assert torch.equal(a, b) and a.shape == (6, ids.shape[1] + 8)
    new = a[:, ids.shape[1] :]
    for r in range(6):
        low = 10 * (r // 3 + 1)
        assert all(low <= t < low + 50 for t in new[r].tolist())  # each row's own batch_id
        assert len(set(new[r].tolist())) == 8  # no_repeat_ngram_size=1: no token twice
    assert len({tuple(r) for r in new[:3].tolist()}) > 1  # the samples differ
    # stock's batch_id (the input row) and stock's padded width + generated, once per token per sample
    assert sorted(seen) == sorted([(b, ids.shape[1] + k) for b in (0, 1) for k in range(8) for _ in range(3)] * 2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_beams=2, no_repeat_ngram_size=2), "no_repeat_ngram_size with beam search"),
        (dict(num_beams=2, logits_processor=LogitsProcessorList([BanRange()])), "logits_processor with beam search"),
        (dict(do_sample=True, logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)])),
         "TemperatureLogitsWarper \\(a sampling warper\\)"),
        (dict(logits_processor=LogitsProcessorList([PrefixConstrainedLogitsProcessor(allowed_tokens, 1)])),
         "PrefixConstrainedLogitsProcessor \\(needs the whole batch\\)"),
        (dict(stopping_criteria=StoppingCriteriaList([EosTokenCriteria(5)])), "stopping_criteria EosTokenCriteria"),
    ],
)
def test_what_cannot_run_per_row_falls_back_with_a_warning_naming_it(llama, kwargs, match):
    ids, mask = padded(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=5, pad_token_id=0, **{"do_sample": False, **kwargs})
    torch.manual_seed(0)
    want = llama.generate(ids, **kw)
    hf_paged.wrap(llama, num_blocks=256, block_size=8)
    _warned.clear()
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=match):
        got = llama.generate(ids, **kw)
    assert torch.equal(got, want)


# -- the engine API -------------------------------------------------------------------------------------


class Recorder(LogitsProcessor):
    """Wraps a processor and records the input_ids of every call."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    def __call__(self, input_ids, scores):
        self.calls.append(input_ids[0].tolist())
        return self.inner(input_ids, scores)


def stock_with(model, prompt, processors, max_new=NEW):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0,
                         logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt) :].tolist()


def test_engine_rows_with_and_without_processors_in_one_batch():
    model = make_model("llama")
    prompts = make_prompts(4, [9, 40, 3, 17], seed=5)
    ngram = NoRepeatNGramLogitsProcessor(1)
    want = [stock_with(model, p, [ngram]) if i % 2 else stock_greedy(model, p, NEW) for i, p in enumerate(prompts)]
    rec = Recorder(ngram)
    engine = PagedGenerator(model, num_blocks=256, block_size=8)
    params = [SamplingParams(max_tokens=NEW, temperature=0, logits_processors=[rec] if i % 2 else None)
              for i in range(4)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert want[1] != stock_greedy(model, prompts[1], NEW)  # the processor mattered
    # called once per generated token per sequence, with prompt + tokens so far
    for i in (1, 3):
        mine = [c for c in rec.calls if c[: len(prompts[i])] == prompts[i]]
        assert mine == [prompts[i] + want[i][:k] for k in range(NEW)]
    engine.kv_manager.check_consistency()
    assert engine.kv_manager.num_free_blocks == 256


def test_engine_processors_survive_preemption_and_skip_speculation():
    model = make_model("llama")
    prompts = make_prompts(6, [30, 45, 20, 38, 50, 25], seed=2)
    ban = SuppressTokensLogitsProcessor([t for p in prompts for t in p[:5]])
    want = [stock_with(model, p, [ban], 24) for p in prompts]
    engine = PagedGenerator(model, num_blocks=20, block_size=16, max_num_batched_tokens=128,
                            speculative_config=dict(method="ngram", num_speculative_tokens=4))
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, logits_processors=[ban]), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = engine.stats()
    assert sum(stats.num_preemptions.values()) > 0 and stats.spec_num_draft_tokens == 0
    engine.kv_manager.check_consistency()
    assert engine.kv_manager.num_free_blocks == 20


def test_engine_stopping_criteria_stop_one_sequence_with_its_token():
    model = make_model("llama")
    prompts = make_prompts(3, [9, 20, 5], seed=8)
    free = [stock_greedy(model, p, NEW) for p in prompts]
    stop_token = free[1][6]
    calls = []

    def criterion(input_ids, scores):
        calls.append((input_ids.shape, scores.shape))
        return input_ids[:, -1] == stop_token

    engine = PagedGenerator(model, num_blocks=128, block_size=8)
    params = [SamplingParams(max_tokens=NEW, temperature=0, stopping_criteria=[criterion] if i == 1 else None)
              for i in range(3)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    first = free[1].index(stop_token)
    assert outs[1].outputs[0].token_ids == free[1][: first + 1] and outs[1].outputs[0].finish_reason == "stop"
    assert [outs[i].outputs[0].token_ids for i in (0, 2)] == [free[0], free[2]]
    assert calls[0] == (torch.Size([1, 21]), torch.Size([1, 512]))
    assert engine.kv_manager.num_free_blocks == 128


def test_engine_n_samples_each_see_their_own_tokens():
    model = make_model("llama")
    prompt = make_prompts(1, [12], seed=4)[0]
    rec = Recorder(NoRepeatNGramLogitsProcessor(1))
    engine = PagedGenerator(model, num_blocks=128, block_size=8)
    out = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=1, n=3, logits_processors=[rec]),
                          use_tqdm=False)[0]
    samples = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in samples}) > 1 and all(len(set(s)) == 10 for s in samples)
    assert sorted(rec.calls) == sorted(prompt + s[:k] for s in samples for k in range(10))


def test_a_failing_processor_or_criterion_fails_its_request_alone():
    model = make_model("llama")
    prompts = make_prompts(3, [9, 20, 5], seed=8)
    want = stock_greedy(model, prompts[0], 8)

    def raises(input_ids, scores):
        raise RuntimeError("boom")

    def wrong_shape(input_ids, scores):
        return scores[0]

    engine = PagedGenerator(model, num_blocks=64, block_size=8)
    params = [SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=8, temperature=0, logits_processors=[wrong_shape]),
              SamplingParams(max_tokens=8, temperature=0, stopping_criteria=[raises])]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want and outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason == "error" and "wrong_shape returned shape (512,)" in outs[1].outputs[0].error
    assert outs[2].outputs[0].finish_reason == "error" and "stopping criterion failed: RuntimeError: boom" in outs[2].outputs[0].error
    engine.kv_manager.check_consistency()
    assert engine.kv_manager.num_free_blocks == 64


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(logits_processors=lambda ids, s: s), "logits_processors must be a list of callables"),
        (dict(logits_processors=[3]), "logits_processors entries must be callable"),
        (dict(stopping_criteria="stop"), "stopping_criteria must be a list of callables"),
    ],
)
def test_bad_hooks_are_refused(kwargs, match):
    with pytest.raises(TypeError, match=match):
        SamplingParams(**kwargs)


def test_processor_list_is_accepted_as_a_list():
    procs = LogitsProcessorList([BanRange()])
    assert SamplingParams(logits_processors=procs).logits_processors == list(procs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SamplingParams(logits_processors=[]).logits_processors is None


def test_engine_order_is_stock_order_penalty_then_processors():
    """Stock puts a custom processor after repetition_penalty; the generation-config sequence_bias before it.
    The two orders give different tokens here, and the engine must give the custom one's."""
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    model = make_model("llama")
    prompt = make_prompts(1, [24], seed=9)[0]
    free = stock_greedy(model, prompt, NEW)
    bias = {(t,): 6.0 for t in set(prompt + free)}
    custom = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                            repetition_penalty=4.0, logits_processor=LogitsProcessorList([SequenceBiasLogitsProcessor(bias)]))
    first = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                           repetition_penalty=4.0, sequence_bias=bias)
    assert not torch.equal(custom, first)
    engine = PagedGenerator(model, num_blocks=64, block_size=8)
    params = SamplingParams(max_tokens=NEW, temperature=0, repetition_penalty=4.0,
                            logits_processors=[SequenceBiasLogitsProcessor(bias)])
    assert engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == custom[0, len(prompt) :].tolist()


def test_streamer_with_a_batch_wide_stop_gets_stock_puts(llama, no_fallback):
    """Without EOS, stock keeps a stopped row generating until every row has stopped: the streamer sees that."""
    from tests.test_hf_generate import Recorder as StreamRecorder

    ids, mask = padded(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
              stopping_criteria=StoppingCriteriaList([StopOnMultipleOf7()]))
    stock = StreamRecorder()
    want = llama.generate(ids, streamer=stock, **kw)
    assert want.shape[1] < ids.shape[1] + NEW  # the criterion ended the batch early
    hf_paged.wrap(llama, num_blocks=256, block_size=8)
    ours = StreamRecorder()
    got = llama.generate(ids, streamer=ours, **kw)
    assert torch.equal(got, want) and ours.puts == stock.puts and ours.ended


def test_assisted_generation_with_processors_does_not_speculate_and_equals_stock(llama, no_fallback):
    prompt = torch.tensor([PROMPTS[1] * 2])  # repeated text: prompt lookup would find drafts
    kw = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, prompt_lookup_num_tokens=3, no_repeat_ngram_size=2)
    want = llama.generate(prompt, **kw)
    hf_paged.wrap(llama, num_blocks=256, block_size=8)
    got = llama.generate(prompt, **kw)
    assert torch.equal(got, want)
    assert llama.paged.stats().spec_num_drafts == 0
    plain = llama.generate(prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0, prompt_lookup_num_tokens=3)
    assert llama.paged.stats().spec_num_drafts > 0 and not torch.equal(plain, got)  # speculation was on offer


def test_a_failing_processor_raises_from_wrapped_generate(llama, no_fallback):
    ids, mask = padded(PROMPTS)

    def nothing_allowed_for_row_2(batch_id, sent):
        return [] if batch_id == 2 else list(range(512))

    hf_paged.wrap(llama, num_blocks=256, block_size=8)
    with pytest.raises(RuntimeError, match="input row 2: .*ValueError: `prefix_allowed_tokens_fn` returned an empty list"):
        llama.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                       prefix_allowed_tokens_fn=nothing_allowed_for_row_2)
    llama.paged.kv_manager.check_consistency()
    assert llama.paged.kv_manager.num_free_blocks == 256


def test_engine_stopping_criteria_stop_each_sample_on_its_own():
    model = make_model("llama")
    prompt = make_prompts(1, [12], seed=4)[0]
    engine = PagedGenerator(model, num_blocks=128, block_size=8)
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3, n=4,
                            stopping_criteria=[lambda ids, scores: bool(ids[0, -1] % 5 == 0)])
    out = engine.generate([prompt], params, use_tqdm=False)[0]
    for c in out.outputs:
        hits = [k for k, t in enumerate(c.token_ids) if t % 5 == 0]
        if hits:
            assert len(c.token_ids) == hits[0] + 1 and c.finish_reason == "stop"
        else:
            assert len(c.token_ids) == 30 and c.finish_reason == "length"
    assert len({len(c.token_ids) for c in out.outputs}) > 1
    assert engine.kv_manager.num_free_blocks == 128


class StopOnCloseCall(StoppingCriteria):
    """Reads stock's accumulated scores: stops a row once its top two processed scores were close."""

    def __call__(self, input_ids, scores):
        top = scores[-1].topk(2, dim=-1).values
        return (top[:, 0] - top[:, 1]) < 0.5


class Flatten(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores * 0.3


@pytest.mark.parametrize("processor", [False, True])
def test_criteria_get_stock_scores_with_output_scores(llama, no_fallback, processor):
    ids, mask = padded(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              output_scores=True, stopping_criteria=StoppingCriteriaList([StopOnCloseCall()]))
    if processor:  # flattens the scores: the criterion fires on processed scores earlier than on raw ones
        kw["logits_processor"] = LogitsProcessorList([BanRange(), Flatten()])
    want = llama.generate(ids, **kw)
    assert want.sequences.shape[1] < ids.shape[1] + NEW  # the criterion fired
    hf_paged.wrap(llama, num_blocks=256, block_size=8)
    got = llama.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)


@pytest.mark.parametrize(
    "criterion,match",
    [
        (lambda ids, scores: torch.tensor([True, False]), "returned shape \\(2,\\), expected one value"),
        (lambda ids, scores: None, "returned None, expected a bool tensor"),
    ],
)
def test_a_criterion_with_a_bad_answer_fails_its_request(criterion, match):
    model = make_model("llama")
    engine = PagedGenerator(model, num_blocks=32, block_size=8)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, stopping_criteria=[criterion]),
                          use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error" and re.search(match, out.error)
    assert engine.kv_manager.num_free_blocks == 32
