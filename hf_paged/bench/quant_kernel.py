"""Per-linear cost of the int8-activation quantized kernels on the CPU, against fp32, at the default model's shapes.

The linears of a SmolLM2-135M decoder layer as the native decode program runs them (hidden 576, MLP 1536, 9 heads
and 3 KV heads of 64: q/k/v joined 960 x 576, o 576 x 576, gate/up joined 3072 x 576, down 576 x 1536) with random
Q4_1 weights, and the tied LM head (49152 x 576, Q8_0, as the GGUF file's embedding). Each kernel runs on the
weight bytes it reads in the engine: ``rows8`` (``hfq8i_linear``) on the interleaved copy, ``blocks``
(``hfq8_linear``) on the GGUF blocks; ``fp32`` is the faster of our packed GEMM and ``F.linear`` on the
dequantized weight. Times are the calling thread's CPU time per call (one thread: ``time.thread_time`` is steady
on a shared machine), the fastest of ``--rounds`` rounds with the kernels taking turns; ``--cold`` cycles through
copies of each weight so that every call reads it from memory, as a decode step does. With ``--ghz`` (the core's
clock under this load) the int8 columns also give the share of the AVX2 peak: 2 VPMADDUBSW (32 multiply-adds
each) per cycle.

    python -m hf_paged.bench.quant_kernel                          # 1 and 64 rows
    HF_PAGED_ISA=avx2 python -m hf_paged.bench.quant_kernel        # an AVX2-only CPU's kernels (set before starting)
    python -m hf_paged.bench.quant_kernel --rows 1,16,64 --ghz 3.5 --cold
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_paged.kernels.cpu import packed_linear
from hf_paged.kernels.cpu.native_gemm import NativePackedWeight
from hf_paged.model.layers import quant_layout, quant_linear as ql

SHAPES = {"qkv": (960, 576, "q4_1"), "o": (576, 576, "q4_1"), "gate_up": (3072, 576, "q4_1"),
          "down": (576, 1536, "q4_1"), "lm_head": (49152, 576, "q8_0")}


def _cases(lib, name: str, rows: int, copies: int, g: torch.Generator) -> dict:
    """kind -> list of no-argument calls (one per weight copy) for one shape and row count."""
    n, k, fmt = SHAPES[name]
    weight = torch.randn(n, k, generator=g) * 0.05
    layer = ql.QuantLinear.from_weight(weight, None, fmt)
    dense = layer.dequantize()
    x = torch.randn(rows, k, generator=g)
    y = torch.empty(rows, n)
    code = ql.FORMATS[fmt]
    twins = [ql.QuantLinear(k, n, fmt, layer.qweight.clone()) for _ in range(copies)]
    qweights = [twin.qweight for twin in twins]

    def c_calls(fn, weights):
        return [lambda w=w: fn(x.data_ptr(), k, w.data_ptr(), code, None, None, y.data_ptr(), n, rows, n, k, 1)
                for w in weights]

    calls = {"blocks": c_calls(lib.hfq8_linear, qweights)}
    if lib.hfq8i_available():
        calls["rows8"] = c_calls(lib.hfq8i_linear, [quant_layout.rows8_copy(twin, lib) for twin in twins])
    dense_copies = [dense.clone() for _ in range(max(1, copies // 4))]  # 4-7x the bytes: fewer copies suffice
    calls["gemm"] = [lambda p=NativePackedWeight(w): p.linear(x, None) for w in dense_copies]
    calls["F.linear"] = [lambda w=w: torch.nn.functional.linear(x, w) for w in dense_copies]
    return calls


def _fastest(calls: dict, rounds: int) -> dict[str, float]:
    """Thread CPU seconds of the fastest round of each kind (a round: one call per copy), the kinds in turn."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds + 1):  # the first round warms up (first-call setup, caches)
        for kind, kind_calls in calls.items():
            start = time.thread_time()
            for call in kind_calls:
                call()
            best[kind] = min(best[kind], (time.thread_time() - start) / len(kind_calls))
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,64", help="comma-separated batch sizes (default 1,64)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cold", action="store_true", help="cycle through weight copies (each call reads from memory)")
    p.add_argument("--ghz", type=float, default=None, help="core clock, for the share of the VPMADDUBSW peak")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    lib = ql.QUANT_Q8.load()
    if lib is None:
        raise SystemExit(f"the int8-activation kernel is not built here: {ql.QUANT_Q8.why}")
    from hf_paged.kernels.cpu import isa

    print(f"one thread, CPU time per call; kernels: {isa.describe()}; {'cold' if args.cold else 'warm'} weights")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in args.shapes.split(","):
            n, k, fmt = SHAPES[name]
            for rows in (int(r) for r in args.rows.split(",")):
                nbytes = n * k // 32 * ql.BLOCK_BYTES[fmt]
                copies = packed_linear.cold_copies(nbytes, 4, 512) if args.cold else 1
                t = _fastest(_cases(lib, name, rows, copies, g), args.rounds)
                fp32 = min(t["gemm"], t["F.linear"])
                line = f"{name:8s} {fmt} {n:5d} x {k:4d}  {rows:3d} rows  fp32 {fp32 * 1e6:9.1f} us"
                for kind in ("rows8", "blocks"):
                    if kind in t:
                        line += f" | {kind} {t[kind] * 1e6:9.1f} us {fp32 / t[kind]:5.2f}x"
                        if args.ghz:
                            peak = rows * n * k / 64 / (args.ghz * 1e9)  # seconds at 2 VPMADDUBSW a cycle
                            line += f" {peak / t[kind]:4.0%}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
