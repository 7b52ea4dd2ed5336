"""wrap()/unwrap() and the HF-compatible generate: tensor equality with stock generate."""

import warnings
from unittest import mock

import pytest
import torch
from transformers import TextIteratorStreamer, TextStreamer
from transformers.generation.streamers import BaseStreamer

import hf_paged
from hf_paged import PagedGenerator
from hf_paged.hf.generate import _warned
from tests.helpers import make_model, make_prompts


def padded(prompts, side="left", pad=0):
    width = max(map(len, prompts))
    rows, masks = [], []
    for p in prompts:
        fill = [pad] * (width - len(p))
        rows.append(fill + p if side == "left" else p + fill)
        masks.append([0] * len(fill) + [1] * len(p) if side == "left" else [1] * len(p) + [0] * len(fill))
    return torch.tensor(rows), torch.tensor(masks)


@pytest.fixture
def llama():
    model = make_model("llama")
    yield model
    if hf_paged.hf.is_wrapped(model):
        hf_paged.unwrap(model)
    model.generation_config.eos_token_id = None


PROMPTS = make_prompts(5, [7, 1, 30, 12, 55], seed=11)


def stock_and_wrapped(model, call):
    want = call(model)
    hf_paged.wrap(model, num_blocks=512, block_size=8)
    got = call(model)
    hf_paged.unwrap(model)
    return want, got


def test_wrap_is_in_place_and_unwrap_restores(llama):
    stock_generate = llama.generate
    x = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        logits = llama(x).logits
    assert hf_paged.wrap(llama) is llama
    assert isinstance(llama.paged, PagedGenerator) and llama.config._attn_implementation == "hf_paged"
    assert llama.generate != stock_generate
    with pytest.warns(UserWarning, match="already wrapped"):
        assert hf_paged.wrap(llama) is llama
    with torch.no_grad():
        assert torch.equal(llama(x).logits, logits)
    hf_paged.unwrap(llama)
    assert not hasattr(llama, "paged") and llama.config._attn_implementation == "sdpa"
    assert llama.generate == stock_generate
    with pytest.warns(UserWarning, match="not wrapped"):
        hf_paged.unwrap(llama)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_new_tokens=20),
        dict(max_length=75),  # a total length counts the padded width, as in stock
        dict(max_new_tokens=15, min_new_tokens=6, eos_token_id=[3, 17, 101]),
        dict(max_new_tokens=12, repetition_penalty=1.3),  # stock skips each row's left padding
        dict(max_new_tokens=12, repetition_penalty=0.7, eos_token_id=5),
    ],
)
def test_padded_batch_equals_stock(llama, kwargs):
    ids, mask = padded(PROMPTS)
    want, got = stock_and_wrapped(
        llama, lambda m: m.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kwargs)
    )
    assert got.shape == want.shape and torch.equal(got, want)


def test_eos_stops_rows_and_pads_after(llama):
    ids, mask = padded(PROMPTS)
    free = llama.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    eos = int(free[2, ids.shape[1] + 3])  # a token row 2 really generates
    want, got = stock_and_wrapped(
        llama, lambda m: m.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=9, eos_token_id=eos)
    )
    assert torch.equal(got, want) and (got == 9).any()


def test_right_padding_gives_each_prompt_its_own_continuation(llama):
    ids_l, mask_l = padded(PROMPTS, "left")
    ids_r, mask_r = padded(PROMPTS, "right")
    hf_paged.wrap(llama, num_blocks=512)
    left = llama.generate(ids_l, attention_mask=mask_l, max_new_tokens=10, do_sample=False, pad_token_id=0)
    right = llama.generate(ids_r, attention_mask=mask_r, max_new_tokens=10, do_sample=False, pad_token_id=0)
    width = ids_l.shape[1]
    assert torch.equal(left[:, width:], right[:, width:])  # stock would continue after the right pads
    assert torch.equal(right[:, :width], ids_r)


def test_inferred_mask_and_1d_input(llama):
    ids, _ = padded(PROMPTS, pad=0)
    want, got = stock_and_wrapped(llama, lambda m: m.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0))
    assert torch.equal(got, want)
    one = torch.tensor(PROMPTS[0])
    want, got = stock_and_wrapped(llama, lambda m: m.generate(one[None], max_new_tokens=8, do_sample=False))
    assert torch.equal(got, want)
    hf_paged.wrap(llama, num_blocks=64)
    assert torch.equal(llama.generate(one, max_new_tokens=8, do_sample=False), want)  # 1-D: one row (stock fails)


def test_sampling_with_num_return_sequences_is_seeded_by_torch(llama):
    ids, mask = padded(PROMPTS[:2])
    hf_paged.wrap(llama, num_blocks=256)
    kw = dict(attention_mask=mask, max_new_tokens=9, do_sample=True, top_k=40, top_p=0.9, num_return_sequences=3, pad_token_id=0)
    torch.manual_seed(7)
    a = llama.generate(ids, **kw)
    torch.manual_seed(7)
    b = llama.generate(ids, **kw)
    c = llama.generate(ids, **kw)
    assert a.shape == (6, ids.shape[1] + 9)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:3, : ids.shape[1]], ids[[0, 0, 0]])
    assert len({tuple(r) for r in a[:3, ids.shape[1]:].tolist()}) > 1  # the 3 samples differ


def test_scores_match_stock(llama):
    ids, mask = padded(PROMPTS[:3])
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_scores=True, repetition_penalty=1.2)
    want, got = stock_and_wrapped(llama, lambda m: m.generate(ids, **kw))
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == 6
    for g, w in zip(got.scores, want.scores):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)



def early_eos(model, ids, mask, row=2, step=3, **kw):
    """A token that input row ``row`` generates at ``step`` (wrapped or not), to end that row early."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=step + 1, pad_token_id=0, **kw)
    return int(out[row, ids.shape[1] + step])


def assert_finished_early(out, width, pad):
    new = out.sequences[:, width:]
    assert ((new[:, -1] == pad) & (new[:, 0] != pad)).any(), "no row finished before the others"


@pytest.mark.parametrize("extra", [{}, dict(repetition_penalty=1.3, no_repeat_ngram_size=2)])
def test_scores_of_rows_finished_early_match_stock(llama, extra):
    # stock keeps running a finished row on its pad tokens and records those logits (processed) in scores
    ids, mask = padded(PROMPTS)
    eos = early_eos(llama, ids, mask, do_sample=False, **extra)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=9, eos_token_id=eos,
              return_dict_in_generate=True, output_scores=True, **extra)
    want, got = stock_and_wrapped(llama, lambda m: m.generate(ids, **kw))
    assert_finished_early(want, ids.shape[1], 9)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == 12
    for g, w in zip(got.scores, want.scores):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_sampled_scores_of_rows_finished_early_match_stock(llama):
    ids, mask = padded(PROMPTS[:3])
    width = ids.shape[1]
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, temperature=0.8, top_k=50, top_p=0.9,
              num_return_sequences=2, pad_token_id=9, return_dict_in_generate=True, output_scores=True)
    hf_paged.wrap(llama, num_blocks=512, block_size=8)
    torch.manual_seed(3)
    eos = int(llama.generate(ids, **kw).sequences[4, width + 3])  # input row 2, first sample
    torch.manual_seed(3)
    got = llama.generate(ids, eos_token_id=eos, **kw)
    hf_paged.unwrap(llama)
    assert_finished_early(got, width, 9)
    # stock along the same path: its draws replaced by the engine's tokens (a finished row's draw becomes pad)
    draws = iter(got.sequences[:, width:].T)
    with mock.patch("torch.multinomial", lambda probs, num_samples: next(draws)[:, None].to(probs.device)):
        want = llama.generate(ids, eos_token_id=eos, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == 10
    for g, w in zip(got.scores, want.scores):  # top-k / top-p leave -inf where stock's warpers do
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_stock_sequence_of_puts(llama):
    ids, mask = padded(PROMPTS[:3])
    free = llama.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    eos = int(free[1, ids.shape[1] + 2])
    records = []

    def call(m):
        rec = Recorder()
        m.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=eos, streamer=rec)
        records.append(rec)

    stock_and_wrapped(llama, call)
    stock, ours = records
    assert ours.puts == stock.puts and ours.ended


def test_unsupported_features_fall_back_with_one_warning(llama):
    ids, mask = padded(PROMPTS[:3])
    beam_sampling = dict(attention_mask=mask, max_new_tokens=7, num_beams=3, do_sample=True, pad_token_id=0)
    processors = dict(attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    torch.manual_seed(0)
    want_sampling = llama.generate(ids, **beam_sampling)
    want_proc = llama.generate(ids, renormalize_logits=True, **processors)
    hf_paged.wrap(llama, num_blocks=256)
    _warned.clear()
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="num_beams with do_sample.*PagedCache"):
        got_sampling = llama.generate(ids, **beam_sampling)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time, no warning
        again = llama.generate(ids, **beam_sampling)
    with pytest.warns(UserWarning, match="renormalize_logits"):  # (logits processors run in the engine)
        got_proc = llama.generate(ids, renormalize_logits=True, **processors)
    assert torch.equal(got_sampling, want_sampling) and torch.equal(again, want_sampling)
    assert torch.equal(got_proc, want_proc)


# -- with the real tokenizer (default model) ------------------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    from hf_paged.model.default_model import load_default

    model, tok = load_default()
    yield model, tok
    if hf_paged.hf.is_wrapped(model):
        hf_paged.unwrap(model)


def chat_batch(tok, questions):
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False) for q in questions]
    tok.padding_side = "left"
    return tok(texts, return_tensors="pt", padding=True)


def test_stop_strings_and_text_streamers_on_default_model(smol):
    model, tok = smol
    enc = chat_batch(tok, ["List three fruits, one per line.", "Count from one to five in words."])
    kw = dict(max_new_tokens=30, do_sample=False, stop_strings=["\n", "three"], tokenizer=tok)
    want = model.generate(**enc, **kw)
    hf_paged.wrap(model, tok, max_num_seqs=8)
    got = model.generate(**enc, **kw)
    assert torch.equal(got, want)
    one = chat_batch(tok, ["Say hello in French."])
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    out = model.generate(**one, max_new_tokens=20, do_sample=False, streamer=streamer)
    streamed = "".join(streamer)
    assert streamed == tok.decode(out[0, one["input_ids"].shape[1]:], skip_special_tokens=True)
    printed = []
    printer = TextStreamer(tok, skip_prompt=True)
    printer.on_finalized_text = lambda text, stream_end=False: printed.append(text)
    model.generate(**one, max_new_tokens=20, do_sample=False, streamer=printer)
    assert "".join(printed).strip() == streamed.strip()
    hf_paged.unwrap(model)


def test_engine_stop_strings_cut_text(smol):
    model, tok = smol
    engine = PagedGenerator(model, tok, max_num_seqs=4)
    prompt = tok.apply_chat_template([{"role": "user", "content": "List three fruits, one per line."}], add_generation_prompt=True, tokenize=True, return_dict=False)
    free = engine.generate([prompt], hf_paged.SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)[0]
    assert "\n" in free.text
    out = engine.generate([prompt], hf_paged.SamplingParams(max_tokens=30, temperature=0, stop=["\n"]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index("\n")]
    assert out.token_ids == free.token_ids[: len(out.token_ids)] and len(out.token_ids) < len(free.token_ids)
    deltas = list(engine.stream(prompt, hf_paged.SamplingParams(max_tokens=30, temperature=0, stop=["\n"])))
    assert "".join(d.text for d in deltas) == out.text
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        hf_paged.SamplingParams(stop=[""])
    engine.close()


def test_pipeline_batches_and_matches_stock(smol):
    from transformers import pipeline

    model, tok = smol
    chats = [[{"role": "user", "content": q}] for q in ["Write a haiku about tea.", "What is 2+2?", "Name three colors."]]
    texts = ["Once upon a time", "The capital of France is"]
    stock = pipeline("text-generation", model=model, tokenizer=tok)
    want_chat = stock(chats, max_new_tokens=16, do_sample=False)
    want_text = stock(texts, max_new_tokens=8, do_sample=False, return_full_text=False)
    pipe = hf_paged.pipeline(model, tok, max_num_seqs=8)
    steps = model.paged.num_steps
    assert pipe(chats, max_new_tokens=16, do_sample=False) == want_chat
    assert model.paged.num_steps - steps <= 16 + 1  # one continuous batch, not one loop per prompt
    assert pipe(texts, max_new_tokens=8, do_sample=False, return_full_text=False) == want_text
    assert pipe(chats[0], max_new_tokens=16, do_sample=False) == want_chat[0]  # a single chat still works
    hf_paged.unwrap(model)
