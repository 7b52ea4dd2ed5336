"""Each example in examples/ runs offline with the default model (short generations)."""

import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wrap_generate(capsys):
    answers = load("wrap_generate").main(max_new_tokens=12)
    assert len(answers) == 3 and "Paris" in answers[0]
    assert "Q: What is the capital of France?" in capsys.readouterr().out


def test_pipeline_chat():
    results = load("pipeline_chat").main(max_new_tokens=12)
    assert len(results) == 2 and all(r[0]["generated_text"][-1]["role"] == "assistant" for r in results)


def test_streaming_engine_and_hf_streamer_agree():
    engine_text, hf_text = load("streaming").main(max_new_tokens=16)
    assert engine_text and engine_text.strip() == hf_text.strip()


def test_paged_cache_beam():
    paged, dynamic, cache = load("paged_cache_beam").main(max_new_tokens=8, num_beams=3)
    assert torch.equal(paged, dynamic) and cache.kv_bytes_used() > 0


@pytest.mark.parametrize("name", ["wrap_generate", "pipeline_chat", "streaming", "paged_cache_beam"])
def test_examples_have_a_cli(name):
    assert "__main__" in (EXAMPLES / f"{name}.py").read_text()
