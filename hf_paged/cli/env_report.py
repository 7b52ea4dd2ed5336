"""``hf-paged env``: what this machine is and which kernels the engine picks here, for bug reports.

In the spirit of ``python -m torch.utils.collect_env`` and ``transformers env``: versions, the CPU and the
vector features that decide our fast paths, the OpenMP runtime and allocator loaded, the C compiler, GPUs,
and for each dtype the linear and attention kernels the engine will use, with the reason.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

TUNING_VARS = ("HF_PAGED_TUNE", "OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")

# The CPU flags that decide hf_paged's paths (x86 /proc/cpuinfo names; ARM "Features" names).
X86_FEATURES = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8",
)
ARM_FEATURES = ("asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm")
PACKAGES = ("torch", "transformers", "triton", "accelerate", "safetensors", "hf-paged")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpuinfo() -> tuple[str, set[str]]:
    name, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return name, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model name", "Hardware") and value.strip():
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return name, flags


def _physical_cores() -> int | None:
    try:
        import psutil

        return psutil.cpu_count(logical=False)
    except Exception:  # noqa: BLE001 - best effort
        return None


def _loaded_libraries() -> list[str]:
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in lines if ".so" in line and "/" in line})


def _runtime_libs() -> tuple[str, str]:
    libs = [os.path.basename(p) for p in _loaded_libraries()]
    omp = [name for name in libs if name.startswith(("libgomp", "libiomp", "libomp"))]
    alloc = [name for name in libs if name.startswith(("libtcmalloc", "libjemalloc", "libmimalloc"))]
    return ", ".join(omp) or "none loaded", ", ".join(alloc) or "glibc malloc"


def _compiler() -> str:
    from hf_paged.kernels.cpu import native

    cc = native.compiler()
    if cc is None:
        return "none found ($CC, cc, gcc, clang)"
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=10).stdout
        first = out.strip().splitlines()[0] if out.strip() else ""
    except (OSError, subprocess.SubprocessError):
        first = "(does not run)"
    return f"{cc} ({shutil.which(cc)}): {first}"


def _gpus() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def kernel_choices(dtype: torch.dtype, device: str = "cpu") -> dict[str, str]:
    """The linear and attention kernels the engine uses for ``dtype`` on ``device``, each with its reason."""
    from hf_paged.kernels.cpu import attention as cpu_attention, fused_ops
    from hf_paged.kernels.cpu import packed_linear
    from hf_paged.kernels.ops import resolve_backend

    if device == "cuda":
        backend = resolve_backend("auto", torch.device("cuda"), dtype)
        return {"linear": "torch (cuBLAS)", "attention": f"{backend}"}
    linear = packed_linear.describe_choice(dtype)
    backend = resolve_backend("auto", torch.device("cpu"), dtype)
    if backend == "cpu":
        attention = "cpu (native C kernel for decode, torch SDPA for prefill chunks)"
    else:
        attention = f"torch (native kernel unavailable: {cpu_attention.unavailable_reason(dtype)})"
    if fused_ops.available(dtype):
        layers = ("fused C kernels for Llama, Mistral and Qwen2 decoder layers (with packed linears: q/k/v and "
                  "gate/up as one GEMM each"
                  + ("; decode steps replayed by the native decode program" if backend == "cpu" else "")
                  + "); transformers' code for others")
    else:
        layers = f"transformers' code (fused kernels unavailable: {fused_ops.unavailable_reason(dtype)})"
    return {"linear": linear, "attention": attention, "layers": layers}


def _quantized_modes() -> dict[str, str]:
    from hf_paged.model.layers import quant_modes
    from hf_paged.model.layers.quant_linear import describe_modes

    return {**describe_modes(), "auto": quant_modes.describe()}


def _isa_level() -> str:
    from hf_paged.kernels.cpu import isa

    try:
        return isa.describe()
    except ValueError as e:  # a bad HF_PAGED_ISA: report it rather than fail the bug report
        return f"invalid: {e}"


def collect() -> dict:
    """Everything ``hf-paged env`` reports, as plain data."""
    cpu, flags = _cpuinfo()
    arm = platform.machine() in ("aarch64", "arm64")
    features = {f: f in flags for f in (ARM_FEATURES if arm else X86_FEATURES)}
    omp, alloc = _runtime_libs()
    info = {
        "versions": {"python": platform.python_version(), **{p: _version(p) for p in PACKAGES}},
        "platform": platform.platform(),
        "cpu": {
            "model": cpu,
            "arch": platform.machine(),
            "physical_cores": _physical_cores(),
            "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa": _isa_level(),
            "features": features,
        },
        "openmp": omp,
        "allocator": alloc,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "tuning": {k: os.environ[k] for k in TUNING_VARS if os.environ.get(k)},
        "c_compiler": _compiler(),
        "gpus": _gpus(),
        "kernels": {name: kernel_choices(dtype) for name, dtype in DTYPES.items()},
        "quantized_linears": _quantized_modes(),
    }
    if info["gpus"]:
        info["kernels_cuda"] = {name: kernel_choices(dtype, "cuda") for name, dtype in DTYPES.items()}
    return info


def format_report(info: dict) -> str:
    v, cpu = info["versions"], info["cpu"]
    have = [f for f, ok in cpu["features"].items() if ok]
    lack = [f for f, ok in cpu["features"].items() if not ok]
    lines = [
        "versions: " + ", ".join(f"{k} {val or 'not installed'}" for k, val in v.items()),
        f"platform: {info['platform']}",
        f"cpu: {cpu['model']} ({cpu['arch']}), {cpu['physical_cores']} physical cores, {cpu['logical_cpus']} "
        f"logical CPUs, torch threads {cpu['torch_threads']}, torch CPU capability {cpu['torch_cpu_capability']}",
        f"kernel ISA level: {cpu.get('isa', '-')}",
        f"vector features: has {' '.join(have) or '-'}; lacks {' '.join(lack) or '-'}",
        f"openmp runtime: {info['openmp']}",
        f"allocator: {info['allocator']}" + (f" (LD_PRELOAD={info['ld_preload']})" if info["ld_preload"] else ""),
        "process tuning: " + (", ".join(f"{k}={v}" for k, v in info["tuning"].items()) or "none"),
        f"c compiler: {info['c_compiler']}",
        f"gpu: {', '.join(info['gpus']) or 'none'}",
    ]
    for name, choice in info["kernels"].items():
        lines.append(f"{name} linear: {choice['linear']}")
        lines.append(f"{name} attention: {choice['attention']}")
        lines.append(f"{name} decoder layers: {choice['layers']}")
    for mode, choice in info.get("quantized_linears", {}).items():
        lines.append(f"quantized linears, {mode} activations: {choice}")
    for name, choice in info.get("kernels_cuda", {}).items():
        lines.append(f"{name} on cuda: linear {choice['linear']}, attention {choice['attention']}")
    return "\n".join(lines)
