"""``hf-paged bench host``: the engine's host time per decode step at long context, without the model's math.

Every step's forward is replaced by zero logits, so what is timed is everything else the engine does per
step: scheduling, the block-table diffs and the packed batch (token ids, slots, attention plan), sampling,
the scheduler's update and the outputs. The workload is ``--num-seqs`` sequences (128) decoding together at
``--context`` tokens (8192) each, on a one-layer model (its KV pool is what makes the context real).
"""

from __future__ import annotations

import random
import time
from collections import defaultdict

import torch
import transformers

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.bench.common import machine_info, patched
from hf_paged.executor.model_runner import ModelRunner

BLOCK_SIZE = 16


def _timer(fn, name: str, totals: dict):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def _tiny_model(max_positions: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=max_positions,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def measure(num_seqs: int = 128, context: int = 8192, steps: int = 32) -> dict:
    """Milliseconds of host work per decode step (total and by part) with ``num_seqs`` sequences at ``context``."""
    max_len = context + steps + 2 * BLOCK_SIZE
    model = _tiny_model(max_len)
    engine = PagedGenerator(
        model, max_num_seqs=num_seqs, block_size=BLOCK_SIZE, max_model_len=max_len,
        num_blocks=num_seqs * (max_len // BLOCK_SIZE + 2), max_num_batched_tokens=16384, enable_prefix_caching=True,
    )
    vocab = model.config.vocab_size

    def no_math(runner, step, model=None):  # zero logits at the sampled rows; the batch is still packed as for a forward
        inputs = getattr(step, "inputs", step)
        return torch.zeros(inputs.logits_indices.shape[0], vocab)

    totals: dict[str, float] = defaultdict(float)
    with patched(ModelRunner, compute_logits=no_math):
        rng = random.Random(0)
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        for _ in range(num_seqs):
            engine.add_request([rng.randrange(vocab) for _ in range(context)], params)
        while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
            engine.step()  # prefill (chunked)
        engine.step()
        for name in ("schedule", "update"):
            setattr(engine.scheduler, name, _timer(getattr(engine.scheduler, name), name, totals))
        with patched(ModelRunner, prepare=_timer(ModelRunner.prepare, "prepare", totals),
                     execute=_timer(ModelRunner.execute, "execute", totals)):
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            total = time.perf_counter() - start
    engine.close()
    ms = lambda s: round(1000 * s / steps, 3)  # noqa: E731
    return {
        "num_seqs": num_seqs, "context": context, "steps": steps,
        "step_ms": ms(total), "schedule_ms": ms(totals["schedule"]), "pack_ms": ms(totals["prepare"]),
        "execute_ms": ms(totals["execute"]), "update_ms": ms(totals["update"]),
        "other_ms": ms(total - totals["schedule"] - totals["execute"] - totals["update"]),
    }


def host(dtype: str = "fp32", repeat: int = 1, systems=None, **_) -> dict:
    import json

    runs = [measure() for _ in range(max(1, repeat))]
    best = min(runs, key=lambda r: r["step_ms"])
    print(f"\n== hf-paged bench host: {best['num_seqs']} sequences x {best['context']} tokens, host ms per decode step ==")
    for key in ("step_ms", "schedule_ms", "pack_ms", "execute_ms", "update_ms", "other_ms"):
        print(f"{key:<12} {best[key]:>9.3f}")
    print("(execute includes pack: the batch packing and attention plan; the forward itself is replaced by zeros)")
    payload = {"workload": "host", **best, "machine": machine_info()}
    print(json.dumps(payload))
    return payload
