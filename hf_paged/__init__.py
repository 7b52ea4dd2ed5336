"""hf_paged: vLLM-class serving for HuggingFace causal LMs (paged KV cache, continuous batching).

Names are imported on first use, so ``import hf_paged.core.scheduler`` (pure Python) pulls in neither
torch nor transformers.
"""

import importlib

from hf_paged import _moved, _transformers_index
from hf_paged.kernels.cpu import isa as _isa

# the module paths from before the layout by layer keep working one release, with a warning (_moved.py)
_moved.install()

# transformers' table of its model modules, read from the store instead of ~3,000 source files (_transformers_index.py)
_transformers_index.install()

# HF_PAGED_ISA=avx2 (or avx512) caps torch's own CPU kernels too; torch reads the caps at its first kernel call.
_isa.apply_torch_caps()

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncPagedEngine": "hf_paged.serving.engine_loop",
    "BeamSearchOutput": "hf_paged.engine.beam_search",
    "BeamSearchParams": "hf_paged.sampling_params",
    "CompletionOutput": "hf_paged.outputs",
    "EngineConfig": "hf_paged.config",
    "EngineClosedError": "hf_paged.serving.engine_loop",
    "EngineFailedError": "hf_paged.serving.engine_loop",
    "EngineStats": "hf_paged.outputs",
    "LoRARequest": "hf_paged.lora.request",
    "PagedCache": "hf_paged.hf.cache",
    "PagedGenerator": "hf_paged.engine.generator",
    "QueueFullError": "hf_paged.serving.engine_loop",
    "RequestOutput": "hf_paged.outputs",
    "RequestStream": "hf_paged.serving.stream",
    "SamplingParams": "hf_paged.sampling_params",
    "StructuredOutputsParams": "hf_paged.structured_params",
    "load_gguf": "hf_paged.model.gguf_loader",
    "pipeline": "hf_paged.hf.pipeline",
    "quantize_model": "hf_paged.model.layers.quantize",
    "unwrap": "hf_paged.hf.wrap",
    "wrap": "hf_paged.hf.wrap",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [*sorted(_EXPORTS), "__version__"]
