"""``hf-paged bench structured``: what grammar masks cost at batch 64, and whether the outputs validate.

The default model answers 64 chat requests at once for a JSON record of a fixed schema, sampled (temperature
0.7, one seed per request), up to 128 new tokens, twice: with ``structured_outputs=json`` and without. The
structured run times every grammar operation of the step loop (bitmask fill and apply, matcher advance and
fork; the compile happens at admission, before the clock) and reports it as a share of step time; both runs
report tokens per second. Outputs of the structured run are parsed and validated with ``jsonschema``.
"""

from __future__ import annotations

import functools
import json
import time

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.bench.common import machine_info, patched
from hf_paged.model.default_model import load_default, parse_dtype
from hf_paged.structured.matchers import StructuredMatchers
from hf_paged.structured_params import StructuredOutputsParams

RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Lagos", "Lima", "Osaka", "Oslo", "Cairo", "Quito", "Perth"]


def record_prompts(tokenizer, n: int) -> list[list[int]]:
    """Chat prompts asking for one person record each (the schema in the words of the request)."""
    chats = [f"Invent a person who lives in {CITIES[i % len(CITIES)]} (person number {i}). Answer with a JSON "
             "object with the fields name, age, city and hobbies (a list of at most three strings)." for i in range(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for c in chats]


class _GrammarClock:
    """Timers for the grammar matchers' operations (seconds spent in grammar work during the steps), installed
    on :class:`StructuredMatchers` while :meth:`installed` is open."""

    NAMES = ("mask", "mask_verify", "accept", "fork", "add")

    def __init__(self) -> None:
        self.seconds = 0.0

    def installed(self):
        return patched(StructuredMatchers, **{name: self._timed(getattr(StructuredMatchers, name)) for name in self.NAMES})

    def _timed(self, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return run


def _run(model, tok, prompts, structured: bool, max_tokens: int) -> dict:
    import jsonschema

    engine = PagedGenerator(model, tok, max_num_seqs=len(prompts))
    wanted = StructuredOutputsParams(json=RECORD_SCHEMA) if structured else None
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, structured_outputs=wanted)
              for i in range(len(prompts))]
    engine.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up (and the one compile)
    clock = _GrammarClock()
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    outs, steps, step_seconds = {}, 0, 0.0
    full = [0.0, 0.0]  # step and grammar seconds of the decode steps that run every request (batch 64)
    with clock.installed():
        while engine.has_unfinished_requests():
            full_batch = len(engine.scheduler.running) == len(prompts) and steps > 0
            grammar_before = clock.seconds
            start = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
            took = time.perf_counter() - start
            step_seconds += took
            steps += 1
            if full_batch:
                full[0] += took
                full[1] += clock.seconds - grammar_before
    engine.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs.values())
    valid = 0
    for o in outs.values():
        try:
            jsonschema.validate(json.loads(o.outputs[0].text), RECORD_SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"requests": len(outs), "tokens": tokens, "steps": steps, "step_seconds": round(step_seconds, 3),
            "tok_per_s": round(tokens / step_seconds, 1), "grammar_seconds": round(clock.seconds, 4),
            "grammar_share": round(clock.seconds / step_seconds, 4), "valid": valid,
            "full_batch_grammar_share": round(full[1] / full[0], 4) if full[0] else None,
            "finish_stop": sum(o.outputs[0].finish_reason == "stop" for o in outs.values()),
            "example": next(iter(outs.values())).outputs[0].text}


def structured(dtype: str = "fp32", repeat: int = 1, batch: int = 64, max_tokens: int = 128, **_) -> dict:
    model, tok = load_default(parse_dtype(dtype))
    prompts = record_prompts(tok, batch)
    results = {}
    for name, on in (("plain", False), ("json_schema", True)):
        runs = [_run(model, tok, prompts, on, max_tokens) for _ in range(max(1, repeat))]
        results[name] = min(runs, key=lambda r: r["step_seconds"] / max(1, r["tokens"]))
    s, p = results["json_schema"], results["plain"]
    print(f"\n== hf-paged bench structured ({dtype}, batch {batch}, at most {max_tokens} new tokens, T=0.7) ==")
    print(f"{'run':<12} {'tokens':>7} {'steps':>6} {'step s':>8} {'tok/s':>8} {'grammar s':>10} {'share':>7} {'valid':>7}")
    for name, r in results.items():
        valid = f"{r['valid']}/{r['requests']}"
        print(f"{name:<12} {r['tokens']:>7} {r['steps']:>6} {r['step_seconds']:>8.2f} {r['tok_per_s']:>8.1f} "
              f"{r['grammar_seconds']:>10.3f} {100 * r['grammar_share']:>6.1f}% {valid:>7}")
    print(f"grammar work: {100 * s['grammar_share']:.1f}% of step time "
          f"({100 * (s['full_batch_grammar_share'] or 0):.1f}% in the decode steps with all {batch} requests), "
          f"{1000 * s['grammar_seconds'] / max(1, s['steps']):.2f} ms per step; "
          f"tok/s {s['tok_per_s'] / p['tok_per_s']:.2f}x of unconstrained; example: {s['example']}")
    payload = {"workload": "structured", "dtype": dtype, "batch": batch, "results": results, "machine": machine_info()}
    print(json.dumps(payload))
    return payload
