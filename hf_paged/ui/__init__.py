"""The Gradio chat demo (``hf-paged chat``): :class:`~hf_paged.ui.chat.ChatDemo` over an engine loop, and its
live engine panel (:mod:`hf_paged.ui.panel`). Needs ``pip install hf-paged[serve]``."""

from hf_paged.ui.chat import ChatDemo, build_prompt

__all__ = ["ChatDemo", "build_prompt"]
