"""Beam search in stock `generate` with a `PagedCache`: beams share prompt blocks, reorders copy no K/V."""

import argparse

from transformers import DynamicCache

import hf_paged
from hf_paged.model.default_model import load_default


def main(max_new_tokens: int = 32, num_beams: int = 4) -> tuple:
    model, tok = load_default()
    inputs = tok.apply_chat_template([{"role": "user", "content": "Describe the ocean in one sentence."}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    kw = dict(max_new_tokens=max_new_tokens, num_beams=num_beams, do_sample=False)
    cache = hf_paged.PagedCache(model, block_size=16)
    # the cache keyword is ``past_key_values`` before transformers 5.24 and ``cache`` from it on
    paged = model.generate(**inputs, **{hf_paged.hf.cache.CACHE_KWARG: cache}, **kw)
    dynamic_cache = DynamicCache(config=model.config)
    dynamic = model.generate(**inputs, **{hf_paged.hf.cache.CACHE_KWARG: dynamic_cache}, **kw)
    print(tok.decode(paged[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    print(f"same tokens as DynamicCache: {bool((paged == dynamic).all())}")
    print(f"PagedCache K/V bytes held: {cache.kv_bytes_used():,}")
    cache.check_consistency()
    return paged, dynamic, cache


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-beams", type=int, default=4)
    args = parser.parse_args()
    main(args.max_new_tokens, args.num_beams)
