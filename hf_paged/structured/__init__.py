"""Structured output (xgrammar): grammars compiled at admission, one matcher per sequence, masks per row."""

from hf_paged.structured.compiler import GrammarCompilerCache, import_xgrammar
from hf_paged.structured.matchers import StructuredMatchers

__all__ = ["GrammarCompilerCache", "StructuredMatchers", "import_xgrammar"]
