"""``pipeline("text-generation")`` over a wrapped model: a list of prompts runs as one continuous batch.

Stock ``TextGenerationPipeline`` calls ``model.generate`` once per prompt unless it is given a
``batch_size``. For a wrapped model, a list of prompts (or of chats) gets ``batch_size = len(list)`` unless the
caller chose one, so the pipeline's own preprocess/postprocess run unchanged around a single ``generate`` call,
and that call runs every row through the paged engine at once. Padding never changes the engine's results
(it strips pads per row), so each output equals what stock generate gives for the prompt alone.
"""

from __future__ import annotations

import functools

from transformers import Pipeline, pipeline as hf_pipeline
from transformers.pipelines.text_generation import TextGenerationPipeline

from hf_paged.hf.wrap import is_wrapped, wrap

_installed = 0  # wrapped models holding the patch; the last unwrap removes it
_original_call = None


def _is_prompt_list(inputs) -> bool:
    if not isinstance(inputs, (list, tuple)) or len(inputs) < 2:
        return False
    # a single chat is a list of message dicts, not a list of prompts
    return all(isinstance(x, str) for x in inputs) or all(isinstance(x, (list, tuple)) for x in inputs)


def install() -> None:
    """Route list calls of text-generation pipelines over wrapped models into one engine batch.

    Counted: every ``wrap`` installs, every ``unwrap`` uninstalls, and the last one restores the stock
    ``TextGenerationPipeline.__call__``.
    """
    global _installed, _original_call
    if _installed == 0:
        original = _original_call = TextGenerationPipeline.__call__

        @functools.wraps(original)
        def __call__(self, text_inputs, **kwargs):
            if is_wrapped(self.model) and "batch_size" not in kwargs and _is_prompt_list(text_inputs):
                kwargs["batch_size"] = len(text_inputs)
            return original(self, text_inputs, **kwargs)

        TextGenerationPipeline.__call__ = __call__
    _installed += 1


def uninstall() -> None:
    global _installed
    if _installed == 0:
        return
    _installed -= 1
    if _installed == 0:
        TextGenerationPipeline.__call__ = _original_call


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
        from hf_paged.default_model import load_model

        model, loaded_tokenizer = load_model(model, dtype=dtype or "fp32", device=device or "cpu")
        tokenizer = tokenizer or loaded_tokenizer
    if tokenizer is None:
        raise ValueError(f"hf_paged.pipeline needs a tokenizer when given a model object ({type(model).__name__}), got tokenizer=None")
    if not is_wrapped(model):
        wrap(model, tokenizer, **engine_config)
    return hf_pipeline("text-generation", model=model, tokenizer=tokenizer)
