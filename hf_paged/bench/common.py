"""Shared benchmark pieces: result rows, the table and JSON line, machine facts, MFU."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hf_paged.kernels.cpu import isa

REPO_DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "chat_prompts.jsonl"


@dataclass
class SystemResult:
    system: str
    tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def chat_prompts_path(path: str | None = None) -> Path:
    if path:
        return Path(path)
    return REPO_DATA


def load_chat_messages(path: str | None = None) -> list[list[dict]]:
    with open(chat_prompts_path(path)) as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def timed(fn, *args, **kwargs):
    gc.collect()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


@contextlib.contextmanager
def patched(cls: type, **methods):
    """Replace methods of ``cls`` (every instance sees them) for the ``with`` block, restored after: benchmarks
    instrument the engine's parts by their class, never by reaching into a live engine's executor."""
    saved = {name: vars(cls)[name] for name in methods}  # KeyError: not a method of cls itself
    try:
        for name, fn in methods.items():
            setattr(cls, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(cls, name, fn)


def best_of(repeat: int, run) -> SystemResult:
    """Run ``run() -> SystemResult`` ``repeat`` times and keep the fastest (machines here are shared)."""
    results = [run() for _ in range(max(1, repeat))]
    return min(results, key=lambda r: r.seconds)


def machine_info() -> dict:
    return {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "isa": isa.describe(),  # the kernels' instruction-set path (HF_PAGED_ISA forces a lower one)
    }


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def matmul_flops(dtype: torch.dtype, device: str = "cpu", n: int = 1024, seconds: float = 1.0) -> float:
    """Measured dense matmul FLOP/s for ``dtype`` on this machine (the denominator of MFU)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(3):
        a @ b
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    if device != "cpu":
        torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start)


def compute_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matmuls: all but the input embedding (unless it doubles as lm_head)."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb
    return total if tied else total - emb.numel()


def print_report(workload: str, dtype: str, results: list[SystemResult], reference: str, extra: dict | None = None) -> dict:
    """Print the table and one JSON line; ratios are hf_paged's tok/s over each system's."""
    ours = next(r for r in results if r.system == reference)
    print(f"\n== hf-paged bench {workload} ({dtype}; CPU kernels: {isa.describe()}) ==")
    print(f"{'system':<44} {'tokens':>7} {'time s':>8} {'tok/s':>8} {'hf_paged speedup':>17}")
    for r in results:
        ratio = ours.tok_per_s / r.tok_per_s
        print(f"{r.system:<44} {r.tokens:>7} {r.seconds:>8.2f} {r.tok_per_s:>8.1f} {ratio:>16.2f}x")
    for key, value in (extra or {}).items():
        print(f"{key}: {value}")
    payload = {
        "workload": workload,
        "dtype": dtype,
        "results": {r.system: {"tokens": r.tokens, "seconds": round(r.seconds, 3), "tok_per_s": round(r.tok_per_s, 2), **r.extra} for r in results},
        "speedup": {r.system: round(ours.tok_per_s / r.tok_per_s, 3) for r in results if r.system != reference},
        **(extra or {}),
        "machine": machine_info(),
    }
    print(json.dumps(payload))
    return payload


def as_dict(r: SystemResult) -> dict:
    return asdict(r)
