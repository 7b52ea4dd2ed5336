"""The kernels: ``store_kv`` and ``paged_attention`` dispatched on device (``ops.py``), their readable
reference (``reference.py``), the vectorized torch path (``torch_attention.py``), the int8 KV rows
(``kv_quant.py``), the graph-safe op for static steps (``graph_ops.py``), the multi-LoRA delta (``lora.py``),
the CPU kernels (``cpu/``) and the Triton kernels (``triton/``).

``from hf_paged.kernels import paged_attention, store_kv, resolve_backend`` works: the names of ``ops.py`` are
looked up on first use, so importing a kernel module (``hf_paged.kernels.cpu.isa``, pure Python, imported by
``hf_paged`` itself) loads neither torch nor the other kernels.
"""

import importlib

_OPS = ("BACKENDS", "TorchAttentionPlan", "paged_attention", "resolve_backend", "store_kv", "store_kv_cpu", "triton_ops")


def __getattr__(name: str):
    if name not in _OPS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("hf_paged.kernels.ops"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_OPS])
