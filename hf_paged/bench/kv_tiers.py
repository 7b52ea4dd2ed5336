"""``hf-paged bench prefix --restart``: time to first token of a long shared prompt from each KV tier.

One prompt of ``prompt_len`` tokens is answered (one new token) four times, each with a different last
token so only the shared blocks can be reused:

1. cold: nothing cached, the whole prompt is prefilled;
2. pool: its blocks are still in the KV pool (an ordinary prefix hit);
3. host: a filler prompt as long has taken the whole pool, so the blocks come back from the host tier;
4. disk: a new engine (as after a restart, in this process: the OS page cache is warm) on the same folder,
   with no host tier of its own, reads them from the disk tier.
"""

from __future__ import annotations

import json
import random
import tempfile
import time

import torch

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.bench.common import machine_info
from hf_paged.kernels.cpu import isa
from hf_paged.model.default_model import load_default, parse_dtype

BLOCK_SIZE = 16


def _warm(engine: PagedGenerator, vocab: int) -> None:
    """One short unrelated request first: a fresh engine's first step pays one-time costs (kernel probes, page
    faults) that are not the prefill's."""
    engine.generate([[1 + i % (vocab - 1) for i in range(8)]], SamplingParams(max_tokens=1), use_tqdm=False)


def _ttft(engine: PagedGenerator, prompt: list[int]) -> tuple[float, list[int]]:
    started = time.perf_counter()
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
    return time.perf_counter() - started, out.outputs[0].token_ids


def tier_ttft(model: torch.nn.Module, prompt_len: int = 1024, folder: str | None = None, vocab: int | None = None,
              seed: int = 0) -> dict:
    """TTFT seconds cold, from the pool, the host tier and the disk tier, with each run's hit counters."""
    vocab = vocab or model.config.vocab_size
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(prompt_len)]
    prompts = [shared + [rng.randrange(3, vocab)] for _ in range(4)]
    # the pool holds one prompt and a little more; the filler takes all of it: every cached block of the
    # shared prefix leaves the pool
    num_blocks = -(-(prompt_len + 2) // BLOCK_SIZE) + 2
    filler = [rng.randrange(3, vocab) for _ in range(num_blocks * BLOCK_SIZE - 1)]
    base = dict(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_model_len=num_blocks * BLOCK_SIZE, max_num_seqs=1,
                long_prefill_token_threshold=None, max_itl_ratio=None)
    offload_gb = 2 * num_blocks * _bytes_per_block(model) / 2**30  # twice the pool: holds the whole prefix
    report: dict = {}
    with tempfile.TemporaryDirectory(dir=folder) as d:
        engine = PagedGenerator(model, kv_offload_gb=offload_gb, prefix_cache_dir=d, **base)
        try:
            _warm(engine, vocab)
            report["cold"], _ = _ttft(engine, prompts[0])
            report["pool"], _ = _ttft(engine, prompts[1])
            engine.generate([filler], SamplingParams(max_tokens=1), use_tqdm=False)
            report["host"], _ = _ttft(engine, prompts[2])
            host_stats = engine.stats().kv_tiers
        finally:
            engine.close()
        engine = PagedGenerator(model, prefix_cache_dir=d, **base)
        try:
            _warm(engine, vocab)
            report["disk"], _ = _ttft(engine, prompts[3])
            disk_stats = engine.stats().kv_tiers
        finally:
            engine.close()
    report = {k: round(v, 4) for k, v in report.items()}
    report["ratio_to_cold"] = {k: round(report[k] / report["cold"], 3) for k in ("pool", "host", "disk")}
    report["host_hits_blocks"] = host_stats["host_hits"]
    report["disk_hits_blocks"] = disk_stats["disk_hits"]
    report["disk_files_skipped"] = disk_stats["disk_files_skipped"]
    return report


def _bytes_per_block(model: torch.nn.Module) -> int:
    c = model.config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    element = next(model.parameters()).element_size()
    return c.num_hidden_layers * 2 * kv_heads * head_dim * max(4, element) * BLOCK_SIZE


def prefix_restart(dtype: str = "fp32", prompt_len: int = 1024, **_) -> dict:
    """The ``--restart`` report on the default model."""
    model, _ = load_default(dtype=parse_dtype(dtype))
    report = tier_ttft(model, prompt_len)
    print(f"\n== hf-paged bench prefix --restart ({dtype}, {prompt_len}-token shared prompt; CPU kernels: "
          f"{isa.describe()}) ==")
    for tier in ("cold", "pool", "host", "disk"):
        ratio = "" if tier == "cold" else f"  ({report['ratio_to_cold'][tier]:.3f}x cold)"
        print(f"TTFT {tier:<5} {report[tier] * 1000:9.1f} ms{ratio}")
    payload = {"workload": "prefix --restart", "dtype": dtype, "prompt_len": prompt_len, **report,
               "machine": machine_info()}
    print(json.dumps(payload))
    return payload
