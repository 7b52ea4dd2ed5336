"""Bigger model shapes for the speed benchmarks (``hf-paged bench chat|latency --model-shape NAME``).

Only the default model's weights ship with the package (no model hub here), so the bigger shapes are built from
their published configs with seeded random weights. That is fine for speed: a step's work depends on the shapes,
not on the values. It is not fine for anything about the text: with random weights EOS almost never comes, so
every answer runs to its token limit, and greedy agreement between systems says little. The default model's
tokenizer (vocabulary 49,152) makes the prompts; every shape's vocabulary is at least that large.

``python -m hf_paged.bench.shapes NAME FOLDER`` saves a shape (safetensors, config, tokenizer) for the other
engines' converters (llama.cpp's ``convert_hf_to_gguf.py``, ``optimum-cli export openvino``).
"""

from __future__ import annotations

import sys

import torch

DEFAULT = "smollm2-135m"
# name -> (model_type, config fields), from the models' published config.json files
SHAPES: dict[str, tuple[str, dict]] = {
    "smollm2-360m": ("llama", dict(
        hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
        vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)),
    "smollm2-1.7b": ("llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=49152, max_position_embeddings=8192, rope_theta=130000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)),
    "qwen2.5-0.5b": ("qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, use_sliding_window=False, bos_token_id=151643, eos_token_id=151643)),
}
NAMES = (DEFAULT, *SHAPES)


def shape_config(name: str):
    """The transformers config of shape ``name`` (one of :data:`SHAPES`)."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ValueError(f"model shape must be one of {list(NAMES)}, got {name!r}")
    model_type, fields = SHAPES[name]
    fields = dict(fields)
    rope_theta = fields.pop("rope_theta")
    config = AutoConfig.for_model(model_type, **fields)
    config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    return config


def load_shape(name: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """``(model, tokenizer)``: the default model for :data:`DEFAULT`, else shape ``name`` with seeded random weights
    in ``dtype`` (eval mode, CPU) and the default model's tokenizer."""
    from hf_paged.model.default_model import load_default

    if name == DEFAULT:
        return load_default(dtype)
    config = shape_config(name)
    from transformers import AutoModelForCausalLM, GenerationConfig

    _, tokenizer = load_default(dtype)  # its tokenizer; the small model is dropped here
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    return model, tokenizer


def save_shape(name: str, folder: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
    """Write shape ``name`` (random weights, ``seed``) as a transformers folder other engines can convert."""
    model, tokenizer = load_shape(name, dtype, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: python -m hf_paged.bench.shapes {{{','.join(SHAPES)}}} FOLDER")
    save_shape(sys.argv[1], sys.argv[2])
