"""Tiny seeded random models and the stock-generate reference used by the parity tests."""

from __future__ import annotations

import functools
import gc

import torch
import transformers

VOCAB = 512

# Small but not degenerate: GQA, several layers, RoPE, and a large enough init that greedy picks are
# decisive (a near-uniform softmax would make parity a test of float rounding instead of the engine).
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.15,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    # a window shorter than the longer prompts, so sliding-window masking really matters
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 48}),
}


@functools.lru_cache(maxsize=None)
def _cached_model(arch: str, seed: int, dtype: torch.dtype, extra: tuple):
    config_cls, model_cls, arch_kw = ARCHS[arch]
    config = config_cls(**{**_COMMON, **arch_kw, **dict(extra)})
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = 0
    return model


def make_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **extra):
    """A fresh (attention implementation reset) tiny random model of ``arch``."""
    gc.collect()  # engines earlier tests dropped without close() give the model back
    model = _cached_model(arch, seed, dtype, tuple(sorted(extra.items())))
    if model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")
    return model


def make_prompts(n: int, lengths: list[int] | None = None, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(1, 64, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for length in lengths]


def stock_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """Tokens from stock ``model.generate(do_sample=False)`` on this prompt alone."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def arrival_chunks(engine, short: list[int], long: list[int], params) -> tuple[list[int], dict[str, list[int]]]:
    """``short`` decodes for 3 steps, then ``long`` arrives: the long prompt's prefill chunk per step until it is
    prefilled, and both requests' tokens ("short", "long") once every request finished. Closes the engine."""
    engine.add_request(short, params, request_id="short")
    for _ in range(3):
        engine.step()  # "short" is decoding
    engine.add_request(long, params, request_id="long")
    seq = next(s for s in engine.scheduler.sequences.values() if s.request_id == "long")
    chunks, done = [], {}
    while engine.has_unfinished_requests():
        before = seq.num_computed_tokens
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if before < len(long):
            chunks.append(seq.num_computed_tokens - before)
    engine.close()
    return chunks, done
