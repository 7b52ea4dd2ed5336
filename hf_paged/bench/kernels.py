"""Paged-attention kernel benchmark: Triton vs the torch path, on a CUDA GPU. Not run in CI.

Decode: achieved bandwidth (GB/s of K and V read from the pool) against the device's peak, over batch
sizes x context lengths. Prefill: attention TFLOP/s (causal FLOPs only) over batch sizes x prompt lengths,
with dense causal SDPA (no paging) as the practical ceiling.

    python -m hf_paged.bench.kernels                                # defaults: bf16, 32 heads / 8 KV heads, head_dim 128
    python -m hf_paged.bench.kernels --dtype fp16 --head-dim 64 --batch-sizes 1,64 --context-lens 1024,16384
    python -m hf_paged.bench.kernels --json results.json            # also write every row as JSON

``--device cpu`` runs tiny shapes under the Triton interpreter: a smoke test of this script, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path


# Nominal HBM bandwidth (GB/s) and dense fp16/bf16 tensor-core TFLOP/s; matched on the lower-cased device name,
# first hit wins. Pass --peak-gbps / --peak-tflops for other devices.
PEAKS = [
    ("h200", 4800, 989),
    ("h100 nvl", 3900, 835),
    ("h100 pcie", 2000, 756),
    ("h100", 3350, 989),
    ("a100-sxm4-80gb", 2039, 312),
    ("a100 80gb pcie", 1935, 312),
    ("a100", 1555, 312),
]
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass
class Row:
    kind: str  # "decode" | "prefill"
    backend: str  # "triton" | "torch" | "sdpa-dense"
    batch: int
    seq_len: int
    ms: float
    gbps: float | None = None  # decode: KV bytes read / time
    tflops: float | None = None  # prefill: causal attention FLOPs / time
    num_splits: int | None = None
    max_abs_diff: float | None = None  # vs the torch path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="default bf16 (fp32 with --device cpu)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch-sizes", type=ints, default=[1, 8, 32, 128], help="decode batch sizes")
    p.add_argument("--context-lens", type=ints, default=[512, 2048, 8192, 32768], help="decode context lengths")
    p.add_argument("--prefill-batch-sizes", type=ints, default=[1, 4])
    p.add_argument("--prefill-lens", type=ints, default=[512, 2048, 8192])
    p.add_argument("--backends", default="triton,torch", help="comma list of triton, torch")
    p.add_argument("--max-kv-gib", type=float, default=16.0, help="skip shapes whose KV pool is larger")
    p.add_argument("--peak-gbps", type=float, default=None, help="override the device's nominal bandwidth")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the device's nominal TFLOP/s")
    p.add_argument("--no-check", action="store_true", help="skip comparing each Triton result with the torch path")
    p.add_argument("--json", type=Path, default=None, help="write all rows to this file")
    return p.parse_args(argv)


def _time_ms(fn, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")  # L2 cache flushed between runs
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _make_pool(torch, args, seq_lens: list[int], q_lens: list[int], dtype):
    """Random pool with each sequence's blocks scattered (a shuffled block table), as after hours of serving."""
    bs, device = args.block_size, args.device
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    k_cache = torch.randn(num_blocks, bs, args.kv_heads, args.head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    i = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = perm[i : i + nb]
        i += nb
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    query = torch.randn(cu[-1], args.heads, args.head_dim, dtype=dtype, device=device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    return query, k_cache, v_cache, block_tables, seq_lens_t, cu_t


def _runners(torch, args, query, k_cache, v_cache, block_tables, seq_lens, cu, max_q, max_k):
    from hf_paged.kernels.ops import TorchAttentionPlan, paged_attention
    from hf_paged.kernels.triton import attention as ta

    scale = args.head_dim**-0.5
    plan = TorchAttentionPlan.build(block_tables, seq_lens, cu, args.block_size)  # once per step in the engine
    common = (query, k_cache, v_cache, block_tables, seq_lens, cu, max_q, max_k, scale)
    return {
        "triton": lambda: ta.paged_attention_triton(*common),
        "torch": lambda: paged_attention(*common, backend="torch", plan=plan),
    }


def bench_decode(torch, args, backends: list[str]) -> list[Row]:
    from hf_paged.kernels.triton import attention as ta

    dtype = getattr(torch, DTYPES[args.dtype])
    elem = torch.finfo(dtype).bits // 8
    rows = []
    for batch in args.batch_sizes:
        for ctx in args.context_lens:
            kv_bytes = 2 * batch * ctx * args.kv_heads * args.head_dim * elem
            if kv_bytes > args.max_kv_gib * 2**30:
                print(f"decode batch={batch} ctx={ctx}: skipped, KV pool {kv_bytes / 2**30:.1f} GiB > --max-kv-gib")
                continue
            tensors = _make_pool(torch, args, [ctx] * batch, [1] * batch, dtype)
            runners = _runners(torch, args, *tensors, 1, ctx)
            splits = ta.choose_num_splits(batch, args.kv_heads, ctx, ta._num_sms(tensors[0].device))
            diff = None
            if not args.no_check and "triton" in backends:
                diff = (runners["triton"]().float() - runners["torch"]().float()).abs().max().item()
            for backend in backends:
                ms = _time_ms(runners[backend], args.device)
                row = Row("decode", backend, batch, ctx, ms, gbps=kv_bytes / ms / 1e6,
                          num_splits=splits if backend == "triton" else None,
                          max_abs_diff=diff if backend == "triton" else None)
                rows.append(row)
                _print_row(row, args)
            del tensors, runners
    return rows


def bench_prefill(torch, args, backends: list[str]) -> list[Row]:
    import torch.nn.functional as F

    dtype = getattr(torch, DTYPES[args.dtype])
    rows = []
    for batch in args.prefill_batch_sizes:
        for length in args.prefill_lens:
            tensors = _make_pool(torch, args, [length] * batch, [length] * batch, dtype)
            flops = 4 * args.heads * args.head_dim * batch * length * (length + 1) / 2  # QK^T and PV, causal half
            runners = _runners(torch, args, *tensors, length, length)
            # the ceiling: dense causal attention over contiguous K/V (FlashAttention through SDPA), no paging
            q = tensors[0].view(batch, length, args.heads, args.head_dim).transpose(1, 2)
            kv = torch.randn(batch, args.kv_heads, length, args.head_dim, dtype=dtype, device=args.device)
            runners["sdpa-dense"] = lambda: F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
            diff = None
            if not args.no_check and "triton" in backends:
                diff = (runners["triton"]().float() - runners["torch"]().float()).abs().max().item()
            for backend in [*backends, "sdpa-dense"]:
                ms = _time_ms(runners[backend], args.device)
                row = Row("prefill", backend, batch, length, ms, tflops=flops / ms / 1e9,
                          max_abs_diff=diff if backend == "triton" else None)
                rows.append(row)
                _print_row(row, args)
            del tensors, runners, q, kv
    return rows


def _print_row(row: Row, args) -> None:
    rate = f"{row.gbps:8.1f} GB/s" if row.gbps is not None else f"{row.tflops:8.2f} TFLOP/s"
    peak = args.peak_gbps if row.gbps is not None else args.peak_tflops
    value = row.gbps if row.gbps is not None else row.tflops
    of_peak = f" ({100 * value / peak:5.1f}% of peak)" if peak else ""
    extra = f" splits={row.num_splits}" if row.num_splits else ""
    if row.max_abs_diff is not None:
        extra += f" max|triton-torch|={row.max_abs_diff:.2e}"
    print(f"{row.kind:7s} {row.backend:10s} batch={row.batch:<4d} len={row.seq_len:<6d} {row.ms:9.3f} ms {rate}"
          f"{of_peak}{extra}", flush=True)


def _device_peaks(torch, args) -> None:
    if args.device != "cuda":
        return
    name = torch.cuda.get_device_name().lower()
    for key, gbps, tflops in PEAKS:
        if key in name:
            args.peak_gbps = args.peak_gbps or gbps
            args.peak_tflops = args.peak_tflops or tflops
            break
    # what a plain device-to-device copy reaches: the practical bandwidth ceiling
    x = torch.empty(2**30 // 2, dtype=torch.float16, device="cuda")
    y = torch.empty_like(x)
    ms = _time_ms(lambda: y.copy_(x), "cuda")
    copy_gbps = 2 * x.numel() * 2 / ms / 1e6
    print(f"device: {torch.cuda.get_device_name()}, nominal peak {args.peak_gbps or '?'} GB/s, "
          f"{args.peak_tflops or '?'} TFLOP/s; measured copy bandwidth {copy_gbps:.0f} GB/s")
    del x, y


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        if args.dtype == "bf16":
            raise SystemExit("--device cpu runs the Triton interpreter, whose tl.dot is wrong on bf16; use fp32/fp16")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU (--device cpu only smoke-tests the script)")
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in ("triton", "torch"):
            raise SystemExit(f"unknown backend {b!r}; choose from triton, torch")
    torch.manual_seed(0)
    _device_peaks(torch, args)
    print(f"dtype={args.dtype} heads={args.heads} kv_heads={args.kv_heads} head_dim={args.head_dim} "
          f"block_size={args.block_size}")
    with torch.inference_mode():
        rows = bench_decode(torch, args, backends) + bench_prefill(torch, args, backends)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
