"""The language-model part of a transformers config. Imports nothing, so every layer may use it."""

from __future__ import annotations


def text_config(model_or_config):
    """The text (language-model) config of a model or of a config: ``get_text_config()`` where the config has it
    (a multimodal config keeps the decoder's settings in a sub-config), else the config itself.

    Args:
        model_or_config: A transformers model (anything with a ``config``) or a config object.
    """
    cfg = model_or_config
    if not hasattr(cfg, "get_text_config") and hasattr(cfg, "config"):  # a model, not a config
        cfg = cfg.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def chunked_attention_size(model) -> int | None:
    """Chunk size of a model with chunked local attention layers (Llama 4), else None.

    Such a layer attends only within fixed chunks of the sequence; the paged kernels have no chunked mask,
    so the engine is exact only for sequences no longer than one chunk (where it equals causal attention).
    """
    cfg = text_config(model)
    size = getattr(cfg, "attention_chunk_size", None)
    if size and "chunked_attention" in (getattr(cfg, "layer_types", None) or ()):
        return int(size)
    return None
