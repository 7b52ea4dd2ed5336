"""``pipeline("text-generation")`` over a wrapped model: a list of prompts runs as one continuous batch.

Stock ``TextGenerationPipeline`` calls ``model.generate`` once per prompt unless it is given a
``batch_size``. For a wrapped model, a list of prompts (or of chats) gets ``batch_size = len(list)`` unless the
caller chose one, so the pipeline's own preprocess/postprocess run unchanged around a single ``generate`` call,
and that call runs every row through the paged engine at once. Padding never changes the engine's results
(it strips pads per row), so each output equals what stock generate gives for the prompt alone.
"""

from __future__ import annotations

from transformers import Pipeline, pipeline as hf_pipeline

from hf_paged.model.default_model import load_model
from hf_paged.hf.wrap import is_wrapped, wrap

def pipeline(model, tokenizer=None, dtype=None, device: str | None = None, **engine_config) -> Pipeline:
    """Load (if given a path), wrap, and return a ``text-generation`` pipeline served by the paged engine.

    Args:
        model: A causal LM, or a local folder to load one (and its tokenizer) from.
        tokenizer: The tokenizer; loaded from the folder when ``model`` is a path.
        dtype: For loading from a path (``torch.float32`` by default).
        device: For loading from a path ("cpu" by default).
        **engine_config: :class:`~hf_paged.EngineConfig` fields.
    """
    if isinstance(model, str):
        model, loaded_tokenizer = load_model(model, dtype=dtype or "fp32", device=device or "cpu")
        tokenizer = tokenizer or loaded_tokenizer
    if tokenizer is None:
        raise ValueError(f"hf_paged.pipeline needs a tokenizer when given a model object ({type(model).__name__}), got tokenizer=None")
    if not is_wrapped(model):
        wrap(model, tokenizer, **engine_config)
    return hf_pipeline("text-generation", model=model, tokenizer=tokenizer)
