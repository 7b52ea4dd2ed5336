"""Structured outputs in the engine: JSON schema, JSON object, regex, choice and EBNF grammars (xgrammar).

A tiny random Llama with the default model's tokenizer: its content is random, so only the grammar makes the
outputs valid. Greedy outputs are compared token for token with stock ``generate`` under xgrammar's own HF
logits processor, and with themselves under preemption, prefix caching and speculative decoding.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from hf_paged import PagedGenerator, SamplingParams  # noqa: E402
from hf_paged.structured_params import StructuredOutputsParams  # noqa: E402
from tests.helpers import make_model  # noqa: E402
from tests.serving_helpers import default_tokenizer, tiny_chat_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "kind", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Give me a record", "Hello there, how are", "JSON please", "A"]


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    with PagedGenerator(tiny_chat_model(tok), tok, max_num_seqs=16, block_size=4, num_blocks=2000) as eng:
        yield eng


def structured(max_tokens: int = 64, temperature: float = 0.0, **kind) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=3 if temperature else None,
                          structured_outputs=StructuredOutputsParams(**kind))


def texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def test_json_schema_outputs_validate_with_n_samples(engine):
    outs = engine.generate(PROMPTS, structured(temperature=1.0, json=SCHEMA).clone(n=3), use_tqdm=False)
    got = [c for o in outs for c in o.outputs]
    assert len(got) == 12
    for c in got:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in got}) > 1  # the samples really are different samples
    engine.kv_manager.check_consistency()
    assert engine.kv_manager.num_used_blocks == 0


def test_json_object_regex_choice_and_grammar(engine):
    # any object: a random model's keys are unbounded, so some run to max_tokens; the finished ones parse
    outs = engine.generate(PROMPTS * 2, structured(temperature=1.0, json_object=True), use_tqdm=False)
    done = [c.text for o in outs for c in o.outputs if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(text), dict) for text in done)
    assert all(c.text.startswith("{") for o in outs for c in o.outputs)
    pattern = r"[a-z]{2,4}-\d{3}"
    for text in texts(engine.generate(PROMPTS, structured(temperature=1.0, regex=pattern), use_tqdm=False)):
        assert re.fullmatch(pattern, text), text
    choices = ["red", "green", "blue sky", 'say "hi"\n', "(.*)"]
    for text in texts(engine.generate(PROMPTS, structured(temperature=1.0, choice=choices), use_tqdm=False)):
        assert text in choices
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for text in texts(engine.generate(PROMPTS, structured(temperature=1.0, grammar=grammar), use_tqdm=False)):
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text


def test_greedy_equals_stock_generate_under_the_same_grammar(engine, tok):
    """Each row masked by its own matcher gives exactly stock greedy under xgrammar's HF logits processor."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    model = engine.model
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=engine.vocab_size, stop_token_ids=sorted(engine.eos_token_ids))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    outs = engine.generate(PROMPTS, structured(max_tokens=40, json=SCHEMA), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            stock = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                   logits_processor=[LogitsProcessor(compiled)], pad_token_id=0,
                                   eos_token_id=sorted(engine.eos_token_ids))
        assert out.outputs[0].token_ids == stock[0, ids.shape[1]:].tolist()


def test_max_tokens_first_is_length(engine):
    out = engine.generate(["Hi"], structured(max_tokens=3, json=SCHEMA), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith("{")


def test_bad_specs_are_value_errors_before_admission_and_others_go_on(engine):
    other = engine.add_request("Hello", SamplingParams(max_tokens=8, temperature=0.0))
    bad = [
        (dict(json={"type": "foo"}), "invalid JSON schema"),
        (dict(json='{"type": '), "not valid JSON"),
        (dict(regex="a(b"), "parenthesis is not closed"),
        (dict(grammar='start ::= "a"'), "root"),
    ]
    for kind, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.add_request("Hi", structured(**kind))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(TypeError, match="choice must be a list"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match="unknown structured_outputs field"):
        SamplingParams(structured_outputs={"json_schema": SCHEMA})
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request("Hi", structured(json=SCHEMA).clone(min_tokens=2))
    assert set(engine.outputs.requests) == {other}  # nothing of the refused requests was admitted
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert done[other].finished and len(done[other].outputs[0].token_ids) == 8


def test_a_dict_is_accepted_and_a_missing_tokenizer_is_named():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs.kind == "choice"
    with PagedGenerator(make_model("llama"), num_blocks=64) as eng:
        with pytest.raises(ValueError, match="tokenizer"):
            eng.add_request([1, 2, 3], params)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_each_matcher(tok, mode):
    model = tiny_chat_model(tok)
    params = structured(max_tokens=48, json=SCHEMA)
    with PagedGenerator(model, tok, block_size=4, num_blocks=2000) as roomy:
        want = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS * 3, params, use_tqdm=False)]
    with PagedGenerator(model, tok, block_size=4, num_blocks=40, preemption_mode=mode, swap_space=1 << 24) as tight:
        outs = tight.generate(PROMPTS * 3, params, use_tqdm=False)
        assert sum(tight.scheduler.num_preemptions.values()) > 0
        assert tight.scheduler.num_preemptions[mode] > 0
        assert tight.kv_manager.num_used_blocks == 0
    assert [o.outputs[0].token_ids for o in outs] == want
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_prefix_cache_hits_give_the_same_structured_output(tok):
    prompt = "A shared system prompt that is long enough to fill several blocks of four tokens. " * 2
    params = structured(max_tokens=40, json=SCHEMA)
    with PagedGenerator(tiny_chat_model(tok), tok, block_size=4, num_blocks=400, enable_prefix_caching=True) as eng:
        first = eng.generate([prompt], params, use_tqdm=False)[0]
        again = eng.generate([prompt + "x"], params, use_tqdm=False)[0]
        again2 = eng.generate([prompt], params, use_tqdm=False)[0]
        assert again2.num_cached_tokens > 0
    assert again2.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.outputs[0].text != "" and json.loads(first.outputs[0].text)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_masks_every_verified_position(tok, method):
    """Greedy output is the same with and without speculation; n-gram drafts copied from a prompt that the
    grammar partly forbids are accepted where it allows them and rejected where not; drafts of an unconstrained
    draft model (the target itself) are rejected wherever the grammar moved the target's choice."""
    model = tiny_chat_model(tok)
    pattern = r'\{"id": [0-9]{1,3}, "ok": (true|false)\}( \{"id": [0-9]{1,3}, "ok": (true|false)\})*'
    prompts = ['{"id": 12, "ok": maybe} {"id": 12, "ok": true} {"id": 12, "ok": false}'] * 2 + PROMPTS
    params = structured(max_tokens=48, regex=pattern)
    with PagedGenerator(model, tok, block_size=4, num_blocks=2000) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = dict(method=method, num_speculative_tokens=4)
    if method == "draft_model":
        spec["model"] = model
    with PagedGenerator(model, tok, block_size=4, num_blocks=2000, speculative_config=spec) as fast:
        outs = fast.generate(prompts, params, use_tqdm=False)
        stats = fast.stats()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    if method == "ngram":
        assert stats.spec_num_accepted_tokens > 0  # the drafts the grammar allows and the target picks
    for o in outs:
        assert o.outputs[0].finish_reason == "length" or re.fullmatch(pattern, o.outputs[0].text)


def test_masks_allow_exactly_what_the_matcher_accepts(engine, tok):
    from hf_paged.structured.matchers import StructuredMatchers

    compiled = engine._grammar_cache().compile(StructuredOutputsParams(regex="ab|ac"))
    matchers = StructuredMatchers()
    matchers.add(7, compiled, engine.eos_token_ids, [])
    logits = torch.zeros(3, engine.vocab_size)
    masked = matchers.mask(logits, [5, 7, 9])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])  # unstructured rows
    allowed = masked[1].isfinite().nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]) in ("a", "ab", "ac") for t in allowed)
    a = tok.convert_tokens_to_ids("a")
    # verification: a forbidden draft ("z") is masked at its own row; the rows after it are not read
    z = tok.convert_tokens_to_ids("z")
    rows = matchers.mask_verify(torch.zeros(3, engine.vocab_size), [7], [[a, z]])
    assert rows[0, a].isfinite() and not rows[1, z].isfinite()
    assert matchers.matchers[7].accept_token(a)  # the walk over the drafts was rolled back


@pytest.mark.slow
def test_default_model_fifty_records_all_validate():
    """The issue's target on the real default model: 50 requests for a record of a schema, 50/50 valid; a
    regex and a choice likewise."""
    from hf_paged.bench.structured import RECORD_SCHEMA, record_prompts
    from hf_paged.model.default_model import load_default

    model, tok = load_default()
    prompts = record_prompts(tok, 50)
    with PagedGenerator(model, tok, max_num_seqs=50) as eng:
        params = [SamplingParams(max_tokens=128, temperature=0.7, seed=i,
                                 structured_outputs=StructuredOutputsParams(json=RECORD_SCHEMA)) for i in range(50)]
        outs = eng.generate(prompts, params, use_tqdm=False)
        for o in outs:
            jsonschema.validate(json.loads(o.outputs[0].text), RECORD_SCHEMA)
        date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
        outs = eng.generate(prompts, structured(max_tokens=16, temperature=0.7, regex=date), use_tqdm=False)
        assert all(re.fullmatch(date, t) for t in texts(outs))
        choices = ["Paris", "Lagos", "somewhere else"]
        outs = eng.generate(prompts, structured(max_tokens=16, temperature=0.7, choice=choices), use_tqdm=False)
        assert all(t in choices for t in texts(outs))


def test_chat_demo_json_schema_box(tok):
    """The demo's "JSON schema" box constrains the answer; an invalid schema is a message in the chat."""
    from hf_paged import AsyncPagedEngine
    from hf_paged.ui.chat import ERROR_PREFIX, ChatDemo

    loop = AsyncPagedEngine(PagedGenerator(tiny_chat_model(tok), tok, num_blocks=256, max_num_seqs=4))
    try:
        demo = ChatDemo(loop)
        *_, (shown, conversation, _) = demo.respond("a record", [], "", 0.0, 1.0, 64, "s1", None, json.dumps(SCHEMA))
        jsonschema.validate(json.loads(shown[-1]["content"]), SCHEMA)
        assert conversation[-1]["content"] == shown[-1]["content"]
        for box, words in (('{"type": "nope"}', "invalid JSON schema"), ("{not json", "not valid JSON"),
                           ("[1]", "JSON object")):
            *_, (shown, conversation, _) = demo.respond("a record", [], "", 0.0, 1.0, 64, "s1", None, box)
            assert shown[-1]["content"].startswith(ERROR_PREFIX) and words in shown[-1]["content"], box
            assert conversation == [{"role": "user", "content": "a record"}]
        *_, (shown, _, _) = demo.respond("hi", [], "", 0.0, 1.0, 4, "s1", None, "  ")  # empty box: free text
        assert shown[-1]["content"] and not shown[-1]["content"].startswith(ERROR_PREFIX)
        assert loop.call(lambda e: e.kv_manager.num_used_blocks).result(10) == 0
    finally:
        loop.shutdown()


def test_logprobs_are_the_models_unmasked_distribution(engine):
    """Masking happens in place only when no row needs its raw logits: logprobs stay the model's own."""
    free = engine.generate(["Hi"], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5), use_tqdm=False)[0]
    params = structured(max_tokens=4, json=SCHEMA)
    both = engine.generate(["Hi", "Hi"], [params.clone(logprobs=5), params], use_tqdm=False)
    free_first, first = free.outputs[0].logprobs[0], both[0].outputs[0].logprobs[0]
    for token, logprob in free_first.items():  # the model's top 5, forbidden ones included, unchanged
        assert first[token] == pytest.approx(logprob)
    assert free.outputs[0].token_ids[0] != both[0].outputs[0].token_ids[0]  # the grammar did change the pick
    assert both[0].outputs[0].token_ids == both[1].outputs[0].token_ids  # with and without logprobs alike


def test_a_slow_compile_never_stalls_running_requests(tok, monkeypatch):
    """Grammars compile on the thread that adds the request: a 2 s compile leaves the engine loop stepping
    the requests already running (a compile inside the step would freeze them for the whole 2 s)."""
    import time

    from hf_paged import AsyncPagedEngine
    from hf_paged.structured.compiler import GrammarCompilerCache

    loop = AsyncPagedEngine(PagedGenerator(tiny_chat_model(tok), tok, num_blocks=512, max_num_seqs=4))
    try:
        loop.generate("warm", structured(max_tokens=2, choice=["a", "b"]))  # the tokenizer info exists now
        compile_once = GrammarCompilerCache._compile

        def slow(self, params, source):
            time.sleep(2.0)
            return compile_once(self, params, source)

        monkeypatch.setattr(GrammarCompilerCache, "_compile", slow)
        running = loop.add_request("Hello", SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True))
        while loop.engine.num_steps < 3:
            time.sleep(0.01)
        before = loop.engine.num_steps
        start = time.time()
        stream = loop.add_request("Hi", structured(json=SCHEMA))  # a new spec: compiled here, for 2 s
        assert time.time() - start >= 2.0
        assert loop.engine.num_steps - before >= 10, "the running request did not advance during the compile"
        jsonschema.validate(json.loads(stream.result().outputs[0].text), SCHEMA)
        running.abort()
    finally:
        loop.shutdown()


def test_beam_search_keeps_every_beam_in_the_grammar(engine, tok):
    """Each beam follows its own matcher (forked with the beam, caught up with the tokens the search appends):
    every returned beam is one of the choices / matches the regex, the constraint changes what unconstrained
    beams say, and every block is free afterwards."""
    from hf_paged import BeamSearchParams

    choices = ["yes", "no", "maybe so", "absolutely not"]
    prompts = ["Answer me", "Is it raining"]
    free = engine.kv_manager.pool.num_free_blocks
    plain = engine.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=8, num_return_sequences=3))
    outs = engine.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=8, num_return_sequences=3,
                                                        structured_outputs={"choice": choices}))
    got = [tok.decode(s.token_ids, skip_special_tokens=True) for o in outs for s in o.sequences]
    assert len(got) == 6 and all(text in choices for text in got), got
    assert [s.token_ids for o in plain for s in o.sequences] != [s.token_ids for o in outs for s in o.sequences]
    pattern = r"[0-9]{3}-[a-z]{2}"
    outs = engine.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=12, num_return_sequences=2,
                                                        structured_outputs=StructuredOutputsParams(regex=pattern)))
    for o in outs:
        for s in o.sequences:
            assert re.fullmatch(pattern, tok.decode(s.token_ids, skip_special_tokens=True))
    with pytest.raises(ValueError, match="min_tokens=2"):
        engine.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=8, min_tokens=2,
                                                     structured_outputs={"choice": choices}))
    with pytest.raises(ValueError, match="regex"):
        engine.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=8, structured_outputs={"regex": "(["}))
    assert engine.kv_manager.pool.num_free_blocks == free


def test_a_grammar_dead_end_fails_only_that_request_naming_the_constraint(engine):
    """``a[^\\s\\S]`` allows "a", then nothing: that request (both samples) fails with an error naming its
    constraint, not "non-finite logits" blamed on the model; the request beside it is untouched."""
    dead = structured(max_tokens=8, temperature=1.0, regex=r"a[^\s\S]").clone(n=2)
    outs = engine.generate(["Hi", "Hello"], [dead, SamplingParams(max_tokens=6, temperature=0.0)], use_tqdm=False)
    for c in outs[0].outputs:
        assert c.finish_reason == "error" and c.text == "a", c
        assert "structured_outputs.regex allows no token after 1 generated token" in c.error, c.error
        assert "non-finite" not in c.error and "model" not in c.error
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 6
    assert engine.kv_manager.num_used_blocks == 0


def test_a_dead_end_under_speculation_and_beam_search_names_the_constraint(tok, engine):
    from hf_paged import BeamSearchParams
    from hf_paged.structured.matchers import StructuredMatchers

    # verification: the matcher walks the drafts "a", "b" into the dead end: that position is reported, the
    # rows before it are masked
    compiled = engine._grammar_cache().compile(StructuredOutputsParams(regex=r"ab[^\s\S]"))  # built on first use
    matchers = StructuredMatchers()
    matchers.add(7, compiled, engine.eos_token_ids, [], kind="regex")
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    dead: dict[int, int] = {}
    rows = matchers.mask_verify(torch.zeros(3, engine.vocab_size), [7], [[a, b]], dead=dead)
    assert dead == {7: 2} and rows[0, a].isfinite() and not rows[0, b].isfinite() and rows[1, b].isfinite()
    assert "after 2 generated token" in matchers.dead_end(7, dead[7])
    spec = dict(method="ngram", num_speculative_tokens=3)
    with PagedGenerator(tiny_chat_model(tok), tok, block_size=4, num_blocks=400, speculative_config=spec) as fast:
        out = fast.generate(["a a a a a a"], structured(max_tokens=8, regex=r"a[^\s\S]"), use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "error" and "structured_outputs.regex" in out.outputs[0].error
        assert fast.kv_manager.num_used_blocks == 0
    # beam search: every beam stuck -> a ValueError naming the constraint (stock beam search returned nothing)
    with pytest.raises(ValueError, match="structured_outputs.regex allows no token"):
        engine.beam_search(["Hi"], BeamSearchParams(beam_width=2, max_tokens=4,
                                                    structured_outputs={"regex": r"a[^\s\S]"}))
    assert engine.kv_manager.num_used_blocks == 0
