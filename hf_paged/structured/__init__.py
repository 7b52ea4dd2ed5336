"""Structured output (xgrammar): grammars compiled at admission, one matcher per sequence, masks per row.

The names below are imported lazily, so the pure-Python checks (:mod:`hf_paged.structured.schema_support`) load
without torch or xgrammar.
"""

import importlib

_EXPORTS = {
    "GrammarCompilerCache": "hf_paged.structured.compiler",
    "import_xgrammar": "hf_paged.structured.compiler",
    "StructuredMatchers": "hf_paged.structured.matchers",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
