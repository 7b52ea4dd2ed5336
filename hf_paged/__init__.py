"""hf_paged: vLLM-class serving for HuggingFace causal LMs (paged KV cache, continuous batching)."""

from hf_paged.config import EngineConfig
from hf_paged.generator import PagedGenerator
from hf_paged.hf.paged_cache import PagedCache
from hf_paged.hf.wrap import unwrap, wrap
from hf_paged.outputs import RequestOutput
from hf_paged.sampling_params import SamplingParams

__version__ = "0.1.0"

def __getattr__(name: str):
    # ``pipeline`` pulls in transformers.pipelines (~4 s of imports): load it on first use only.
    if name == "pipeline":
        from hf_paged.hf.pipeline import pipeline

        return pipeline
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EngineConfig", "PagedCache", "PagedGenerator", "RequestOutput", "SamplingParams", "__version__", "pipeline", "unwrap",
    "wrap",
]
