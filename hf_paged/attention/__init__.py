"""The "hf_paged" attention function registered in transformers (``function.py``: `AttentionMetadata`,
`enable`, ...) and the attention backend objects chosen once per engine (``backends.py``).

Our code imports those two modules; for code written against the old single module, the names of
``function.py`` are looked up here on first use."""

import importlib


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("hf_paged.attention.function"), name)
