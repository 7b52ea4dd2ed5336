"""``hf-paged bench arrival``: a running stream's inter-token latency while a long prompt arrives.

One request decodes (the stream); after it has produced ``WARM`` tokens, a ``--context``-token prompt (4000)
arrives. The stream's inter-token latency (ITL) is timed in process, step by step, from the arrival until
``TAIL`` tokens after the long prompt's first token. Systems: ``paced`` (the defaults: ``max_itl_ratio=3`` with
``long_prefill_token_threshold=256``), ``threshold`` (the 256-token cap alone) and ``off`` (neither: the prompt's
prefill takes whole steps of ``max_num_batched_tokens``). Reported per system: the stream's decode ITL before
the arrival, the median, p99 and longest ITL during it, p99 over the decode median, and the long prompt's time
to first token.
"""

from __future__ import annotations

import json
import random
import statistics
import time

import torch

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.bench.common import machine_info

WARM = 24  # stream tokens before the arrival (their ITL is the decode baseline)
TAIL = 16  # stream tokens after the long prompt's first token
STREAM_TOKENS = 2000  # the stream's max_tokens (it is aborted once measured)
SYSTEMS = {
    "paced": {},
    "threshold": {"max_itl_ratio": None},
    "off": {"max_itl_ratio": None, "long_prefill_token_threshold": None},
}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def measure(model, stream_ids: list[int], long_ids: list[int], engine_kw: dict) -> dict:
    max_len = max(len(long_ids), len(stream_ids) + STREAM_TOKENS) + 64
    engine = PagedGenerator(model, max_model_len=max_len, **engine_kw)
    try:
        greedy = dict(temperature=0.0, ignore_eos=True)
        # warm-up: a prompt of a few chunks beside a decode, so one-time costs are not timed
        engine.add_request(stream_ids, SamplingParams(max_tokens=8, **greedy))
        engine.add_request(long_ids[-300:][::-1], SamplingParams(max_tokens=2, **greedy))
        while engine.has_unfinished_requests():
            engine.step()
        stream = engine.add_request(stream_ids, SamplingParams(max_tokens=STREAM_TOKENS, **greedy))
        times: list[float] = []
        arrival = first = None
        long_id = None
        while True:
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                if out.request_id == stream:
                    times.append(now)
                elif out.request_id == long_id and first is None and out.outputs[0].token_ids:
                    first = now
            if arrival is None and len(times) == WARM:
                arrival = time.perf_counter()
                long_id = engine.add_request(long_ids, SamplingParams(max_tokens=1, **greedy))
            if first is not None and times and times[-1] >= first and sum(t > first for t in times) >= TAIL:
                break
        engine.abort(stream)
        engine.step()
    finally:
        engine.close()
    itl = [b - a for a, b in zip(times, times[1:])]
    decode = itl[: WARM - 1][2:]  # the decode baseline (its first two skipped)
    during = [gap for gap, end in zip(itl, times[1:]) if end > arrival]
    median = statistics.median(decode)
    ms = lambda s: round(1000 * s, 1)  # noqa: E731
    return {
        "decode_itl_ms": ms(median), "itl_median_ms": ms(statistics.median(during)),
        "itl_p99_ms": ms(_percentile(during, 0.99)), "itl_max_ms": ms(max(during)),
        "p99_over_decode": round(_percentile(during, 0.99) / median, 2), "long_ttft_s": round(first - arrival, 2),
        "stream_tokens_during": len(during),
    }


def arrival(dtype: str = "fp32", repeat: int = 1, systems: set[str] | None = None, context: int = 4000, **_) -> dict:
    from hf_paged.model.default_model import load_default

    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    model, tokenizer = load_default(dtype=torch_dtype)
    stream_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}], add_generation_prompt=True,
        tokenize=True, return_dict=False,
    )
    rng = random.Random(0)
    chosen = [name for name in SYSTEMS if systems is None or name in systems or name == "paced"]
    results = {}
    for name in chosen:
        runs = []
        for r in range(max(1, repeat)):
            long_ids = [rng.randrange(100, model.config.vocab_size) for _ in range(context)]  # fresh: no cache hits
            runs.append(measure(model, list(stream_ids), long_ids, SYSTEMS[name]))
        results[name] = min(runs, key=lambda x: x["itl_p99_ms"])
    print(f"\n== hf-paged bench arrival: a stream's ITL while a {context}-token prompt arrives ({dtype}) ==")
    cols = ["decode_itl_ms", "itl_median_ms", "itl_p99_ms", "itl_max_ms", "p99_over_decode", "long_ttft_s"]
    print(f"{'system':<10}" + "".join(f"{c:>17}" for c in cols))
    for name, res in results.items():
        print(f"{name:<10}" + "".join(f"{res[c]:>17}" for c in cols))
    payload = {"workload": "arrival", "dtype": dtype, "context": context, "results": results, "machine": machine_info()}
    print(json.dumps(payload))
    return payload
