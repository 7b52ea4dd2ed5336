"""The text-generation pipeline patch that :func:`hf_paged.wrap` installs (see :mod:`hf_paged.hf.pipeline`):
a list of prompts given to a pipeline over a wrapped model runs as one ``generate`` call, one engine batch."""

from __future__ import annotations

import functools

from transformers.pipelines.text_generation import TextGenerationPipeline

_installed = 0  # wrapped models holding the patch; the last unwrap removes it
_original_call = None


def _is_prompt_list(inputs) -> bool:
    if not isinstance(inputs, (list, tuple)) or len(inputs) < 2:
        return False
    # a single chat is a list of message dicts, not a list of prompts
    return all(isinstance(x, str) for x in inputs) or all(isinstance(x, (list, tuple)) for x in inputs)


def install(is_wrapped) -> None:
    """Route list calls of text-generation pipelines over wrapped models into one engine batch.

    Counted: every ``wrap`` installs, every ``unwrap`` uninstalls, and the last one restores the stock
    ``TextGenerationPipeline.__call__``. ``is_wrapped(model)`` tells a wrapped model (``hf_paged.hf.wrap``).
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
