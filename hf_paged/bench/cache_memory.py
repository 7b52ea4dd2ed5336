"""K/V memory of ``PagedCache`` vs ``DynamicCache`` for one beam-search ``generate``.

    python -m hf_paged.bench.cache_memory --model default --prompt-len 512 --new-tokens 64 --num-beams 4

Both runs use stock ``model.generate`` with the same inputs; the script checks they return the same tokens.
DynamicCache bytes are its key/value tensors at the end; PagedCache reports the blocks rows hold at the end,
the most they ever held, and the pool tensors it allocated.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from hf_paged.hf.cache import CACHE_KWARG, PagedCache


@dataclass
class CacheMemory:
    dynamic_bytes: int
    paged_used_bytes: int
    paged_peak_bytes: int
    paged_reserved_bytes: int
    dynamic_seconds: float
    paged_seconds: float
    same_tokens: bool


def dynamic_cache_kv_bytes(cache: DynamicCache) -> int:
    """Bytes of a DynamicCache's key and value tensors (every layer)."""
    return sum(
        t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)
    )


def measure_beam_memory(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    num_beams: int = 4,
    block_size: int = 16,
) -> CacheMemory:
    """Run one beam search with each cache and compare their K/V bytes at the end.

    Args:
        model: a decoder-only transformers model.
        input_ids: ``[batch, prompt_len]`` prompt token ids (no padding).
        max_new_tokens: tokens to generate.
        num_beams: beams per prompt.
        block_size: PagedCache block size.
    """
    kw = dict(
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        num_beams=num_beams,
        do_sample=False,
        pad_token_id=model.generation_config.pad_token_id or 0,
    )
    dynamic = DynamicCache(config=model.config)
    paged = PagedCache(model, block_size=block_size)
    with torch.inference_mode():
        model.generate(input_ids[:, :8], **{**kw, "attention_mask": None, "max_new_tokens": 2, "min_new_tokens": 2})
        t0 = time.perf_counter()
        ref = model.generate(input_ids, **{CACHE_KWARG: dynamic}, **kw)
        t1 = time.perf_counter()
        out = model.generate(input_ids, **{CACHE_KWARG: paged}, **kw)
        t2 = time.perf_counter()
    paged.check_consistency()
    return CacheMemory(
        dynamic_bytes=dynamic_cache_kv_bytes(dynamic),
        paged_used_bytes=paged.kv_bytes_used(),
        paged_peak_bytes=paged.tables.peak_used_blocks * paged.bytes_per_block,
        paged_reserved_bytes=paged.kv_bytes_reserved(),
        dynamic_seconds=t1 - t0,
        paged_seconds=t2 - t1,
        same_tokens=torch.equal(ref, out),
    )


def _tiny_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.15, pad_token_id=0,
        eos_token_id=None, bos_token_id=None,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="'tiny' (random 2-layer Llama), 'default' (SmolLM2-135M) or a path")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--num-beams", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)

    from hf_paged.model.default_model import load_default, load_model, parse_dtype

    dtype = parse_dtype(args.dtype)
    if args.model == "tiny":
        model = _tiny_model().to(dtype)
    elif args.model == "default":
        model, _ = load_default(dtype=dtype)
    else:
        model, _ = load_model(args.model, dtype=dtype)
    model.generation_config.eos_token_id = None  # generate exactly --new-tokens tokens
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, model.config.vocab_size, (1, args.prompt_len), generator=g)
    m = measure_beam_memory(model, input_ids, args.new_tokens, args.num_beams, args.block_size)

    mib = 1 << 20
    print(f"model={args.model} dtype={args.dtype} prompt={args.prompt_len} new={args.new_tokens} "
          f"beams={args.num_beams} block_size={args.block_size} same_tokens={m.same_tokens}")
    print("| cache | K/V bytes | MiB | vs DynamicCache |")
    print("|---|---:|---:|---:|")
    for name, b in (
        ("DynamicCache (end)", m.dynamic_bytes),
        ("PagedCache blocks held (end)", m.paged_used_bytes),
        ("PagedCache blocks held (peak)", m.paged_peak_bytes),
        ("PagedCache pool allocated", m.paged_reserved_bytes),
    ):
        print(f"| {name} | {b:,} | {b / mib:.2f} | {b / m.dynamic_bytes:.2f}x |")
    print(f"generate seconds: DynamicCache {m.dynamic_seconds:.2f}, PagedCache {m.paged_seconds:.2f}")


if __name__ == "__main__":
    main()
