"""Compiling a :class:`~hf_paged.structured_params.StructuredOutputsParams` into an xgrammar grammar.

Compiles run on the thread that adds the request (the caller's, or a server worker's), never inside a step:
a slow compile stalls nobody else. Each distinct constraint is compiled once (xgrammar's compiler caches by
content, and so do we, by :meth:`~hf_paged.structured_params.StructuredOutputsParams.key`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable

from hf_paged.structured.validation import check_json_schema, xgrammar_message
from hf_paged.structured_params import StructuredOutputsParams

_EXTRA_HINT = "pip install 'hf-paged[structured]'"


def import_xgrammar():
    """The ``xgrammar`` module, or an ImportError naming the extra to install."""
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(f"structured outputs need xgrammar: {_EXTRA_HINT} ({e})") from None
    return xgrammar


class GrammarCompilerCache:
    """One engine's grammar compiler: xgrammar's ``TokenizerInfo`` and ``GrammarCompiler`` for its tokenizer.

    Args:
        tokenizer: The engine's HF tokenizer.
        vocab_size: Rows of the model's logits (may exceed ``len(tokenizer)``: padding tokens are never allowed).
        stop_token_ids: The tokens that end a completed grammar (the model's end-of-sequence tokens).
        max_entries: Compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], max_entries: int = 256) -> None:
        xgr = import_xgrammar()
        stops = sorted(stop_token_ids)
        if not stops:
            raise ValueError("structured outputs need an end-of-sequence token to end a completed grammar; the "
                             "model and tokenizer define none")
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.max_entries = max_entries
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0
        self._json_mask = None

    def json_token_mask(self):
        """int32 bitmask ``[vocab_size / 32]`` of the tokens a JSON output may contain: all but those whose text
        holds a raw control character (U+0000..U+001F). Compact JSON has none (inside strings they are escaped),
        but xgrammar's strings with minLength / maxLength allow them, which would break the JSON; special tokens
        stay allowed (the grammar decides on them)."""
        with self._lock:
            if self._json_mask is None:
                import numpy as np
                import torch

                special = set(self.info.special_token_ids)
                bits = np.zeros(-(-self.vocab_size // 32) * 32, dtype=bool)
                for token, text in enumerate(self.info.decoded_vocab[: self.vocab_size]):
                    bits[token] = token in special or not any(byte < 0x20 for byte in text)
                words = np.packbits(bits, bitorder="little").view(np.int32)
                self._json_mask = torch.from_numpy(words.copy())
            return self._json_mask

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params`` (cached); an invalid schema, regex or grammar is a ValueError."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(params)
        with self._lock:
            self._cache[key] = compiled
            self.num_compiles += 1
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams):
        kind = params.kind
        try:
            if kind == "json":
                schema = check_json_schema(params.json)
                return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":  # literals of an EBNF rule (JSON string escapes are EBNF's)
                literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
                return self.compiler.compile_grammar(f"root ::= {literals}")
            return self.compiler.compile_grammar(params.grammar)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for a bad spec
            raise ValueError(f"invalid structured_outputs.{kind}: {xgrammar_message(e)}") from None


def prepare_params(cache: GrammarCompilerCache, params):
    """``params`` (a :class:`~hf_paged.sampling_params.SamplingParams` or ``BeamSearchParams`` with
    ``structured_outputs``) checked for what structured output cannot combine with, and copied with its grammar
    compiled (ValueError if invalid)."""
    import dataclasses

    wanted = params.structured_outputs
    if wanted.compiled is not None:
        return params
    if params.min_tokens:
        raise ValueError(f"structured_outputs cannot combine with min_tokens={params.min_tokens}: the grammar may "
                         "complete earlier, and then only a stop token is allowed; use min_tokens=0")
    if params.ignore_eos and not params.stop_token_ids:
        raise ValueError("structured_outputs with ignore_eos=True needs stop_token_ids: a completed grammar ends "
                         "the request with a stop token")
    mine = dataclasses.replace(wanted)  # the engine's own copy carries the grammar; the caller's stays as given
    mine.compiled = cache.compile(wanted)
    if wanted.kind in ("json", "json_object"):
        mine.token_mask = cache.json_token_mask()
    return dataclasses.replace(params, structured_outputs=mine)
