"""Per-linear cost of the multi-LoRA deltas on the CPU: the slots' torch layouts against the C kernel.

The seven projections of a decoder layer of the default model (SmolLM2-135M: hidden 576, MLP 1536, 3 KV heads
of 64), 4 resident rank-16 adapters, fp32. Each case times ``slot(x, y)`` (the eager forward's call: plan
inputs, then the deltas) with the torch layouts (``USE_KERNEL = False``) and with the kernel, and the kernel's
bare C call as the native decode program replays it (prebuilt arguments). Times are the calling thread's CPU time
per linear (``time.thread_time``: steady on a shared machine; with several threads it leaves out the helpers'
share, so the default runs one thread).

    python -m hf_paged.bench.lora_kernel                 # T = 1 (one adapter) and T = 64 (rows over 4 adapters)
    python -m hf_paged.bench.lora_kernel --threads 2     # torch and the kernel on 2 threads (wall time too)
    python -m hf_paged.bench.lora_kernel --end-to-end    # the default model: process CPU time per token

``--end-to-end`` generates 32 greedy tokens per row (batch 1 and 64) on the default model with
``hf-paged bench lora``'s four adapters: base rows, adapter rows with the kernel, and adapter rows with the torch
layouts, each after a warm-up on its own engine, and prints the process CPU time per generated token.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from hf_paged.kernels.cpu import lora_ops
from hf_paged.lora import slots as lora_slots
from hf_paged.lora.loading import LoRALayerWeights
from hf_paged.lora.slots import LoRASlot, plan_step

SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]  # q k v o gate up down
NUM_ADAPTERS, RANK = 4, 16


class _Source:
    plan = None


def _slots(source) -> list[LoRASlot]:
    g = torch.Generator().manual_seed(0)
    slots = []
    for n_in, n_out in SHAPES:
        slot = LoRASlot(source, n_in, n_out, NUM_ADAPTERS, RANK, torch.device("cpu"), torch.float32)
        for s in range(NUM_ADAPTERS):
            a, b = torch.randn(RANK, n_in, generator=g) / 24, torch.randn(n_out, RANK, generator=g)
            slot.set(s, LoRALayerWeights(a, b, 1.0))
        slots.append(slot)
    return slots


def _time(fn, min_s: float = 0.3) -> tuple[float, float]:
    """(thread CPU us, wall us) per call of ``fn``, over at least ``min_s`` of thread time after a warm-up."""
    for _ in range(3):
        fn()
    n, cpu0, wall0 = 0, time.thread_time(), time.perf_counter()
    while time.thread_time() - cpu0 < min_s:
        fn()
        n += 1
    return (time.thread_time() - cpu0) / n * 1e6, (time.perf_counter() - wall0) / n * 1e6


def run(threads: int = 1) -> list[dict]:
    torch.set_num_threads(threads)
    source = _Source()
    slots = _slots(source)
    cases = {"T=1, one adapter": [0], "T=64 over 4 adapters": [t % NUM_ADAPTERS for t in range(64)]}
    rows = []
    with torch.inference_mode():
        for name, token_slots in cases.items():
            source.plan = plan_step(token_slots, torch.device("cpu"))
            T = len(token_slots)
            xs = [torch.randn(T, n_in) for n_in, _ in SHAPES]
            ys = [torch.zeros(T, n_out) for _, n_out in SHAPES]

            def layer(xs=xs, ys=ys):
                for slot, x, y in zip(slots, xs, ys):
                    slot(x, y)
            result = {"case": name, "layout": source.plan.layout}
            for label, use in (("torch", False), ("kernel", True)):
                lora_slots.USE_KERNEL = use
                cpu, wall = _time(layer)
                result[f"{label} cpu us"], result[f"{label} wall us"] = cpu / len(SHAPES), wall / len(SHAPES)
            lora_slots.USE_KERNEL = True
            cells = ctypes.c_void_p(source.plan.token_slot.data_ptr()), ctypes.c_int(T)
            calls = [lora_ops.replay_call(x, y, s.a, s.bt, s.scales_t, s.ranks_t, threads, *cells)
                     for s, x, y in zip(slots, xs, ys)]

            def bare(calls=calls):
                for fn, args in calls:
                    fn(*args)
            cpu, wall = _time(bare)
            result["C call cpu us"], result["C call wall us"] = cpu / len(SHAPES), wall / len(SHAPES)
            rows.append(result)
    return rows


def end_to_end(threads: int = 1, max_tokens: int = 32) -> list[str]:
    import tempfile

    from hf_paged import PagedGenerator, SamplingParams
    from hf_paged.bench.lora import make_adapters
    from hf_paged.model.default_model import load_default

    torch.set_num_threads(threads)
    model, tok = load_default(torch.float32)
    with tempfile.TemporaryDirectory() as folder:
        loras = make_adapters(model, folder)
        prompts = ["Tell me a story about a cat."] * 64

        def per_token(batch: int, lora_request: list, use_kernel: bool) -> float:
            lora_slots.USE_KERNEL = use_kernel
            try:
                with PagedGenerator(model, tok, max_num_seqs=64, enable_lora=True, max_loras=NUM_ADAPTERS) as engine:
                    engine.generate(prompts[:batch], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False,
                                    lora_request=lora_request)
                    start = time.process_time()
                    outs = engine.generate(prompts[:batch], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                           ignore_eos=True),
                                           use_tqdm=False, lora_request=lora_request)
                    return (time.process_time() - start) / sum(len(o.outputs[0].token_ids) for o in outs) * 1e3
            finally:
                lora_slots.USE_KERNEL = True

        lines = []
        for batch in (1, 64):
            adapters = [loras[i % NUM_ADAPTERS] for i in range(batch)]
            base = per_token(batch, [None] * batch, True)
            kernel, plain = per_token(batch, adapters, True), per_token(batch, adapters, False)
            lines.append(f"batch {batch}: CPU ms per token: base {base:.3f}, kernel {kernel:.3f} "
                         f"({base / kernel:.2f}x), torch layouts {plain:.3f} ({base / plain:.2f}x)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--end-to-end", action="store_true", help="the default model, base vs adapters")
    args = parser.parse_args()
    if args.end_to_end:
        print("\n".join(end_to_end(args.threads)))
        return
    rows = run(args.threads)
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for k in keys))


if __name__ == "__main__":
    main()
