"""The standard workloads (docs/benchmarks.md): ``chat``, ``mixed``, ``latency``, ``prefix`` and ``serve``."""

from __future__ import annotations

import random
import time

import torch

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.bench.baselines import hf_generate_batch, hf_padded_generate
from hf_paged.bench.common import (
    SystemResult, best_of, compute_params, load_chat_messages, matmul_flops, print_report,
)
from hf_paged.bench.shapes import DEFAULT as DEFAULT_SHAPE, load_shape
from hf_paged.model.default_model import load_default, parse_dtype
from hf_paged.engine.engine_setup import token_id_list

ENGINE = "hf_paged"
EAGER = "eager"  # --systems name of the engine run with enforce_eager=True (chat, latency)
TP2 = "tp2"  # --systems name of the engine with tensor_parallel_size=2 (chat)
# --systems names of the tensor-parallel engines (chat): tp2, and tp2 on weights quantized at start
TP2_SYSTEMS = {TP2: {}, "tp2-int8": {"quantization": "int8"}, "tp2-int4": {"quantization": "int4"}}
# --systems names of the engine on quantized weights (chat, latency); "-a8" / "-bf16": with int8 / bf16 activations
QUANT_ACTIVATIONS = {"": "float", "a8": "int8", "bf16": "bf16"}
QUANTIZED = tuple(f"{n}{'-' if a else ''}{a}" for n in ("gguf_q4_1", "int8", "int4") for a in QUANT_ACTIVATIONS)
# --systems names of the workloads here, the default set of each (hf_paged.bench.systems adds the engine variants
# above that chat and latency also take)
SYSTEMS = {"chat": ("padded", "generate_batch", ENGINE), "mixed": ("static16", "generate_batch", ENGINE),
           "latency": ("padded", ENGINE), "prefix": ("no_prefix_cache", "generate_batch", ENGINE)}


def quantized_engine(name: str, dtype: str, model) -> tuple:
    """``(model, engine keywords)`` of a :data:`QUANTIZED` system (the GGUF file's weights load anew)."""
    base, _, mode = name.partition("-")
    kw = {"quant_activations": QUANT_ACTIVATIONS[mode]} if mode else {}
    if base == "gguf_q4_1":
        return load_default(parse_dtype(dtype), quantized=True)[0], kw
    return model, {**kw, "quantization": base}


def run_engine(model, prompts, params, engine_kw: dict, track_kv: bool = False) -> tuple[SystemResult, list[list[int]], dict]:
    """Time hf_paged from first submission to last token; optionally track KV allocation and RSS per step."""
    import psutil

    engine = PagedGenerator(model, **engine_kw)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    engine.kv_manager.reset_prefix_cache()  # the timed run starts cold
    params = params if isinstance(params, list) else [params] * len(prompts)
    peak = (0, 1)
    proc = psutil.Process()
    rss_start = rss_peak = proc.memory_info().rss
    peak_used_blocks = 0
    start = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if track_kv:
            allocated = engine.kv_manager.num_allocated_slots()
            held = sum(r.num_computed_tokens for r in engine.scheduler.running)
            if allocated > peak[0] and held:
                peak = (allocated, held)
            peak_used_blocks = max(peak_used_blocks, engine.kv_manager.num_used_blocks)
            rss_peak = max(rss_peak, proc.memory_info().rss)
    seconds = time.perf_counter() - start
    engine_stats = engine.stats()
    mib = 2**20
    stats = {"steps": engine.num_steps, "preemptions": sum(engine.scheduler.num_preemptions.values()),
             "kv_pool": f"{engine.pool.capacity_tokens} tokens, {engine.pool.total_bytes / 2**20:.1f} MiB, "
                        f"{str(engine.pool.cache_dtype).removeprefix('torch.')}",
             "kv_waste": round(peak[0] / peak[1], 3) if track_kv else None,
             "prefix_cache_hit_rate": round(engine_stats.prefix_cache_hit_rate, 3)}
    if track_kv:
        stats["kv_memory_mib"] = {
            "pool": round(engine.pool.total_bytes / mib, 1),
            "peak_live_kv": round(peak_used_blocks * engine.pool.bytes_per_block / mib, 1),
            "peak_rss_growth": round((rss_peak - rss_start) / mib, 1),
        }
    if engine.config.tensor_parallel_size > 1:
        from hf_paged.executor.tensor_parallel import COMM

        stats["comm"] = {"broadcast_ms_per_step": round(1e3 * engine.executor.comm_seconds / engine.num_steps, 2),
                         "collective_ms_per_step": round(1e3 * COMM.seconds / engine.num_steps, 2),
                         "collective_kib_per_step": round(COMM.bytes / 1024 / engine.num_steps, 1),
                         "collectives_per_step": round(COMM.calls / engine.num_steps, 1)}
    engine.close()
    outputs = [done[i] for i in ids]
    return SystemResult(ENGINE, sum(len(o) for o in outputs), seconds, {"steps": stats["steps"]}), outputs, stats


def _eager_run(model, prompts, params, engine_kw: dict, repeat: int) -> SystemResult:
    """The engine with ``enforce_eager=True`` (no native decode program, buckets or graphs), for A/B runs."""
    runs = [run_engine(model, prompts, params, {**engine_kw, "enforce_eager": True}) for _ in range(max(1, repeat))]
    res = min(runs, key=lambda r: r[0].seconds)[0]
    res.system = f"{ENGINE}, enforce_eager"
    return res


def _kv_name(system: str, kv_cache_dtype: str) -> str:
    return system if kv_cache_dtype == "auto" else f"{system}, {kv_cache_dtype} KV"


def _kv_label(res: SystemResult, kv_cache_dtype: str) -> SystemResult:
    res.system = _kv_name(res.system, kv_cache_dtype)
    return res


def _warm_hf(model, prompts, pad_id):
    hf_padded_generate(model, prompts[:2], [4, 4], pad_id, None)


def chat(dtype: str = "fp32", repeat: int = 1, systems: set[str] | None = None, kv_cache_dtype: str = "auto",
         model_shape: str = DEFAULT_SHAPE, **_) -> dict:
    model, tok = load_shape(model_shape, parse_dtype(dtype))
    messages = load_chat_messages()
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False) for m in messages]
    eos = {tok.eos_token_id} | set(token_id_list(model.generation_config.eos_token_id))
    limits = [128] * len(prompts)
    want = systems or set(SYSTEMS["chat"])
    results = []
    pad = tok.pad_token_id or 0
    _warm_hf(model, prompts, pad)
    hf_outputs = None
    if "padded" in want:
        runs = [hf_padded_generate(model, prompts, limits, pad, eos) for _ in range(max(1, repeat))]
        res, hf_outputs = min(runs, key=lambda r: r[0].seconds)
        results.append(res)
    if "generate_batch" in want:
        results.append(best_of(repeat, lambda: hf_generate_batch(model, prompts, limits, eos)[0]))
    params = SamplingParams(max_tokens=128, temperature=0.0)
    kw = dict(max_num_seqs=len(prompts), kv_cache_dtype=kv_cache_dtype)
    if EAGER in want:
        results.append(_kv_label(_eager_run(model, prompts, params, kw, repeat), kv_cache_dtype))
    extra = {"requests": len(prompts), "model": _model_label(model_shape)}
    tp_outputs = {}
    for name, tp_kw in TP2_SYSTEMS.items():  # the engine sharded over 2 processes (they share this machine's cores)
        if name not in want:
            continue
        from hf_paged.executor.tensor_parallel import COMM

        tp_runs = []
        for _ in range(max(1, repeat)):
            COMM.seconds, COMM.bytes, COMM.calls = 0.0, 0, 0
            tp_runs.append(run_engine(model, prompts, params, {**kw, **tp_kw, "tensor_parallel_size": 2}))
        tp_res, tp_outputs[name], tp_stats = min(tp_runs, key=lambda r: r[0].seconds)
        quant = f", quantization={tp_kw['quantization']}" if tp_kw else ""
        tp_res.system = f"{_kv_name(ENGINE, kv_cache_dtype)}, tensor_parallel_size=2{quant}"
        results.append(tp_res)
        extra[f"{name}_comm_(last_run)"] = tp_stats["comm"]
    engines, outputs, stats = _engine_rounds(want, dtype, model, prompts, params, kw, repeat)
    results += engines
    extra["kv_pool"] = stats["kv_pool"]
    one_process = {TP2: outputs, **{f"tp2-{n}": o for n, o in stats.get("quantized_outputs", {}).items()}}
    for name, got in tp_outputs.items():  # each against the one-process engine with the same weights, if it ran
        if name in one_process:
            same = sum(a == b for a, b in zip(one_process[name], got))
            extra[f"{name}_same_tokens_as_one_process"] = f"{same}/{len(prompts)}"
    if hf_outputs is not None:
        # Greedy outputs of a padded batch and of the engine should agree (fp32: exactly, in practice).
        extra["same_tokens_as_hf_generate"] = f"{sum(a == b for a, b in zip(outputs, hf_outputs))}/{len(prompts)}"
    return print_report("chat", dtype, results, _kv_name(ENGINE, kv_cache_dtype), extra)


def _engine_rounds(want, dtype, model, prompts, params, base: dict, repeat) -> tuple[list[SystemResult], list, dict]:
    """hf_paged and each wanted :data:`QUANTIZED` system (engine keywords ``base`` and their own), ``repeat``
    rounds taking turns (so a busy moment of a shared machine falls on every system alike): the fastest run of
    each counts, every run's seconds are kept, and each quantized system's greedy outputs are compared with
    hf_paged's. Returns the results, hf_paged's outputs and its run's stats."""
    systems = [(ENGINE, model, {})] + [(n, *quantized_engine(n, dtype, model)) for n in QUANTIZED if n in want]
    kv_cache_dtype = base.get("kv_cache_dtype", "auto")
    best: dict[str, SystemResult] = {}
    runs: dict[str, list[float]] = {}
    outputs: dict[str, list] = {}
    stats: dict = {}
    for _ in range(max(1, repeat)):
        for name, m, kw in systems:
            res, outputs[name], run_stats = run_engine(m, prompts, params, {**base, **kw})
            runs.setdefault(name, []).append(round(res.seconds, 2))
            if name not in best or res.seconds < best[name].seconds:
                best[name] = res
                if name == ENGINE:
                    stats = run_stats
    stats["quantized_outputs"] = {name: outputs[name] for name, _, _ in systems if name != ENGINE}
    for name, _, _ in systems:
        res = best[name]
        res.system = _kv_name(ENGINE if name == ENGINE else f"{ENGINE}, {name}", kv_cache_dtype)
        res.extra["runs_s"] = runs[name]
        if name != ENGINE:
            same = sum(a == b for a, b in zip(outputs[name], outputs[ENGINE]))
            res.extra["same_greedy_tokens_as_hf_paged"] = f"{same}/{len(prompts)}"
    return [best[name] for name, _, _ in systems], outputs[ENGINE], stats


def mixed_model(dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=32000, max_position_embeddings=2048, eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def mixed_requests(n: int = 64, seed: int = 0, vocab: int = 32000) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(16, 512))])
        outs.append(rng.randint(16, 256))
    return prompts, outs


def mixed(dtype: str = "fp32", repeat: int = 1, systems: set[str] | None = None, **_) -> dict:
    torch_dtype = parse_dtype(dtype)
    model = mixed_model(torch_dtype)
    prompts, limits = mixed_requests()
    want = systems or set(SYSTEMS["mixed"])
    results = []
    _warm_hf(model, prompts, 0)
    hf_waste = None
    if "static16" in want:
        results.append(best_of(repeat, lambda: hf_padded_generate(
            model, prompts, limits, 0, None, batch_size=16, label="HF generate (static batches of 16)")[0]))
        hf_waste = _static_batch_waste(prompts, limits, 16)
    if "generate_batch" in want:
        results.append(best_of(repeat, lambda: hf_generate_batch(model, prompts, limits, None)[0]))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in limits]
    runs = [run_engine(model, prompts, params, dict(max_num_seqs=len(prompts)), track_kv=True) for _ in range(max(1, repeat))]
    res, _, stats = min(runs, key=lambda r: r[0].seconds)
    results.append(res)
    flops = matmul_flops(torch_dtype)
    n_params = compute_params(model)
    extra = {
        "requests": len(prompts),
        "kv_waste_hf_paged": stats["kv_waste"],
        "kv_waste_hf_static_batches": hf_waste,
        "kv_memory_mib": stats.get("kv_memory_mib"),
        "mfu": {r.system: round(2 * n_params * r.tok_per_s / flops, 4) for r in results},
        "matmul_gflops": round(flops / 1e9, 1),
        "compute_params": n_params,
    }
    return print_report("mixed", dtype, results, ENGINE, extra)


def _static_batch_waste(prompts, limits, batch_size) -> float:
    """Peak padded-DynamicCache slots over the real tokens they hold, batch by batch."""
    peak = (0, 1)
    for start in range(0, len(prompts), batch_size):
        p = prompts[start : start + batch_size]
        n = limits[start : start + batch_size]
        allocated = len(p) * (max(map(len, p)) + max(n))
        held = sum(len(a) + b for a, b in zip(p, n))
        if allocated > peak[0]:
            peak = (allocated, held)
    return round(peak[0] / peak[1], 3)


def latency(dtype: str = "fp32", repeat: int = 1, systems: set[str] | None = None, kv_cache_dtype: str = "auto",
            model_shape: str = DEFAULT_SHAPE, **_) -> dict:
    model, tok = load_shape(model_shape, parse_dtype(dtype))
    text = " ".join(m[0]["content"] for m in load_chat_messages())
    prompt = tok(text)["input_ids"][:128]
    want = systems or set(SYSTEMS["latency"])
    results = []
    _warm_hf(model, [prompt, prompt], tok.pad_token_id or 0)
    if "padded" in want:
        results.append(best_of(repeat, lambda: hf_padded_generate(model, [prompt], [256], 0, None, label="HF generate")[0]))
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    base = dict(max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
    if EAGER in want:
        results.append(_kv_label(_eager_run(model, [prompt], params, base, repeat), kv_cache_dtype))
    results += _engine_rounds(want, dtype, model, [prompt], params, base, repeat)[0]
    ms = {r.system: round(1000 * r.seconds / r.tokens, 2) for r in results}
    return print_report("latency", dtype, results, _kv_name(ENGINE, kv_cache_dtype),
                        {"ms_per_output_token": ms, "model": _model_label(model_shape)})


def _model_label(model_shape: str) -> str:
    return "SmolLM2-135M-Instruct" if model_shape == DEFAULT_SHAPE else f"{model_shape} shape, random weights"


def prefix_requests(n: int = 64, prefix_len: int = 512, suffix_len: int = 32, seed: int = 0, vocab: int = 32000):
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    return [shared + [rng.randrange(3, vocab) for _ in range(suffix_len)] for _ in range(n)]


def prefix(dtype: str = "fp32", repeat: int = 1, systems: set[str] | None = None, **_) -> dict:
    """64 requests sharing a 512-token prefix (unique 32-token suffixes), 32 new tokens each."""
    model = mixed_model(parse_dtype(dtype))
    prompts = prefix_requests()
    limits = [32] * len(prompts)
    want = systems or set(SYSTEMS["prefix"])
    results = []
    _warm_hf(model, prompts, 0)
    if "generate_batch" in want:
        results.append(best_of(repeat, lambda: hf_generate_batch(model, prompts, limits, None)[0]))
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    off_outputs = None
    if "no_prefix_cache" in want:
        runs = [run_engine(model, prompts, params, dict(max_num_seqs=64, enable_prefix_caching=False))
                for _ in range(max(1, repeat))]
        res, off_outputs, _ = min(runs, key=lambda r: r[0].seconds)
        res.system = "hf_paged, prefix caching off"
        results.append(res)
    runs = [run_engine(model, prompts, params, dict(max_num_seqs=64)) for _ in range(max(1, repeat))]
    res, outputs, stats = min(runs, key=lambda r: r[0].seconds)
    results.append(res)
    extra = {"requests": len(prompts), "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"]}
    if off_outputs is not None:
        extra["same_tokens_as_prefix_caching_off"] = f"{sum(a == b for a, b in zip(outputs, off_outputs))}/{len(prompts)}"
    extra["kv_blocks_n8_vs_8_separate"] = fork_blocks(model, prompts[0])
    return print_report("prefix", dtype, results, ENGINE, extra)


def fork_blocks(model, prompt: list[int], n: int = 8, new_tokens: int = 32) -> dict:
    """Peak KV blocks of one request with ``n`` samples vs ``n`` separate requests (prefix caching off, so
    only the fork shares), block size 16."""
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=0)
    peaks = {}
    for label, requests in (("n=8", [params.clone(n=n)]), ("8 separate", [params.clone(seed=i) for i in range(n)])):
        # no prefill pacing: all n requests hold their blocks at once, as the samples of one request do
        engine = PagedGenerator(model, block_size=16, num_blocks=1024, max_num_seqs=n, enable_prefix_caching=False,
                                max_itl_ratio=None)
        for sp in requests:
            engine.add_request(prompt, sp)
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.kv_manager.num_used_blocks)
        engine.close()
        peaks[label] = peak
    peaks["ratio"] = round(peaks["n=8"] / peaks["8 separate"], 3)
    return peaks


def _spec(**kw):
    from hf_paged.bench.spec import spec

    return spec(**kw)


def _startup(**kw):
    from hf_paged.bench.startup import startup

    return startup(**kw)


def _lora(**kw):
    from hf_paged.bench.lora import lora

    return lora(**kw)


def _arrival(**kw):
    from hf_paged.bench.arrival import arrival

    return arrival(**kw)


def _structured(**kw):
    from hf_paged.bench.structured import structured

    return structured(**kw)


def _replicas(**kw):
    from hf_paged.bench.replicas import replicas

    return replicas(**kw)


def _serve(**kw):
    from hf_paged.bench.serve import serve

    return serve(**kw)


def _host(**kw):
    from hf_paged.bench.host import host

    return host(**kw)


WORKLOADS = {
    "chat": chat, "mixed": mixed, "latency": latency, "prefix": prefix, "spec": _spec, "serve": _serve, "host": _host,
    "arrival": _arrival, "structured": _structured, "replicas": _replicas, "lora": _lora,
    "startup": _startup,
}
