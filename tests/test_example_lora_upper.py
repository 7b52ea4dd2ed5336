"""examples/train_lora_upper.py's core on a tiny random model (two optimizer steps, not the real training)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_lora_upper.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_lora_upper", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's tokenizer (its files only: the model weights are not read)."""
    from transformers import AutoTokenizer

    from hf_paged.model.default_model import default_model_path

    try:
        return AutoTokenizer.from_pretrained(str(default_model_path()))
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"the default model's tokenizer is not available: {e}")


def test_train_save_and_serve_upper_case_adapter(tokenizer, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    script = _script()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    questions = script.training_prompts()[:4]
    answers = script.base_answers(model, tokenizer, questions, max_tokens=6)
    examples = script.training_examples(tokenizer, questions, answers)
    for (ids, prompt_len), question, answer in zip(examples, questions, answers):
        assert ids[:prompt_len] == script.chat_ids(tokenizer, question)
        assert tokenizer.decode(ids[prompt_len:-1]) == answer.upper() and ids[-1] == tokenizer.eos_token_id

    peft_model = script.train_lora(model, examples, rank=4, steps=2, batch_size=2)
    trained = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert trained and all(p.abs().sum() > 0 for p in trained)  # B starts at zero: two steps moved it
    size = script.save_adapter(peft_model, tmp_path / "upper")
    assert size > 0 and json.loads((tmp_path / "upper" / "adapter_config.json").read_text())["r"] == 4
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(tmp_path / "upper" / "adapter_model.safetensors").values()} == {torch.float16}
    base = peft_model.unload()
    rows = script.serve_mixed(base, tokenizer, tmp_path / "upper", questions[:2], max_tokens=6, max_lora_rank=4)
    assert [q for q, _, _ in rows] == questions[:2]
    assert [b for _, b, _ in rows] == answers[:2]  # the base rows of the mixed batch: the base model's answers
