"""HF-facing adapters: what plugs hf_paged into stock transformers APIs."""

from hf_paged.hf.cache import PagedCache
from hf_paged.hf.wrap import is_wrapped, unwrap, wrap

def __getattr__(name: str):
    # ``pipeline`` pulls in transformers.pipelines (~4 s of imports): load it on first use only.
    if name == "pipeline":
        from hf_paged.hf.pipeline import pipeline

        return pipeline
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PagedCache", "is_wrapped", "pipeline", "unwrap", "wrap"]
