"""HF-facing adapters: what plugs hf_paged into stock transformers APIs."""

from hf_paged.hf.paged_cache import PagedCache
from hf_paged.hf.pipeline import pipeline
from hf_paged.hf.wrap import is_wrapped, unwrap, wrap

__all__ = ["PagedCache", "is_wrapped", "pipeline", "unwrap", "wrap"]
