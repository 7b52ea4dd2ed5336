"""hf_paged: vLLM-class serving for HuggingFace causal LMs (paged KV cache, continuous batching)."""

from hf_paged.config import EngineConfig
from hf_paged.generator import PagedGenerator
from hf_paged.outputs import RequestOutput
from hf_paged.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["EngineConfig", "PagedGenerator", "RequestOutput", "SamplingParams", "__version__"]
