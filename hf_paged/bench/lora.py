"""``hf-paged bench lora``: multi-LoRA serving against the base model alone (docs/benchmarks.md).

The 64 chat prompts on the default model, greedy, 128 new tokens each (EOS ignored, so every system does the same
work): the base model on a plain engine; the base model on an engine with ``enable_lora`` and no adapter rows
(what the slots cost when idle); and the prompts spread over 4 random rank-16 adapters on q/k/v/o and
gate/up/down (made with peft, ``init_lora_weights=False``), all in one batch. Batch 1 runs the first 4 prompts
one at a time, base and with an adapter. Throughput ratios are over the base model in the same run.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch

from hf_paged import LoRARequest, PagedGenerator, SamplingParams
from hf_paged.bench.common import load_chat_messages, machine_info
from hf_paged.model.default_model import load_default, parse_dtype

NUM_ADAPTERS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model, folder: str, rank: int = 16) -> list[LoRARequest]:
    """``NUM_ADAPTERS`` random PEFT adapters of ``model`` saved under ``folder``; ``model`` is left as it was."""
    try:
        import peft
    except ImportError as e:  # optional dependency
        raise ImportError("bench lora makes its adapters with peft: pip install hf-paged[lora]") from e
    requests = []
    for i in range(NUM_ADAPTERS):
        torch.manual_seed(100 + i)
        config = peft.LoraConfig(init_lora_weights=False, r=rank, lora_alpha=rank, target_modules=TARGETS)
        peft_model = peft.get_peft_model(model, config)
        path = os.path.join(folder, f"adapter{i}")
        peft_model.save_pretrained(path)
        model = peft_model.unload()  # the base linears back in place, the adapter dropped
        requests.append(LoRARequest(f"adapter{i}", i + 1, path))
    return requests


def _run(model, tok, prompts, loras, enable_lora: bool, one_at_a_time: bool, max_tokens: int) -> dict:
    engine = PagedGenerator(model, tok, max_num_seqs=64, enable_lora=enable_lora, max_loras=NUM_ADAPTERS)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False,
                    lora_request=loras[0] if loras else None)  # warm-up (and the adapters' first load)
    for request in {r.lora_int_id: r for r in loras if r is not None}.values():
        engine.add_lora(request)
    engine.kv_manager.reset_prefix_cache()
    start = time.perf_counter()
    if one_at_a_time:
        outs = [engine.generate([p], params, use_tqdm=False, lora_request=r)[0] for p, r in zip(prompts, loras)]
    else:
        outs = engine.generate(prompts, params, use_tqdm=False, lora_request=list(loras))
    seconds = time.perf_counter() - start
    engine.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "seconds": round(seconds, 2), "tok_per_s": round(tokens / seconds, 2)}


def lora(dtype: str = "fp32", repeat: int = 1, max_tokens: int = 128, batch1_prompts: int = 4, **_) -> dict:
    model, tok = load_default(parse_dtype(dtype))
    messages = load_chat_messages()
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
               for m in messages]
    with tempfile.TemporaryDirectory(prefix="hf_paged_bench_lora_") as folder:
        adapters = make_adapters(model, folder)
        spread = [adapters[i % NUM_ADAPTERS] for i in range(len(prompts))]
        one = prompts[:batch1_prompts]
        cases = {
            (len(prompts), "base"): (prompts, [None] * len(prompts), False, False),
            (len(prompts), "lora engine, base rows"): (prompts, [None] * len(prompts), True, False),
            (len(prompts), f"{NUM_ADAPTERS} adapters"): (prompts, spread, True, False),
            (1, "base"): (one, [None] * len(one), False, True),
            (1, "1 adapter"): (one, [adapters[0]] * len(one), True, True),
        }
        table = {}
        for key, (group, loras, enable, alone) in cases.items():
            runs = [_run(model, tok, group, loras, enable, alone, max_tokens) for _ in range(max(1, repeat))]
            table[key] = min(runs, key=lambda r: r["seconds"])
    print(f"\n== hf-paged bench lora ({dtype}, {max_tokens} new tokens, greedy, EOS ignored, rank 16 on "
          f"{len(TARGETS)} projections) ==")
    print(f"{'batch':>5} {'system':<24} {'tokens':>7} {'time s':>8} {'tok/s':>8} {'vs base':>8}")
    payload = {"workload": "lora", "dtype": dtype, "results": {}, "machine": machine_info()}
    for (batch, name), r in table.items():
        ratio = r["tok_per_s"] / table[(batch, "base")]["tok_per_s"]
        print(f"{batch:>5} {name:<24} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tok_per_s']:>8.1f} {ratio:>7.2f}x")
        payload["results"][f"batch{batch}/{name}"] = r | {"vs_base": round(ratio, 3)}
    print(json.dumps(payload))
    return payload
