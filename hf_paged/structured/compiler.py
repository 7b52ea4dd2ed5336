"""Compiling a :class:`~hf_paged.structured_params.StructuredOutputsParams` into an xgrammar grammar.

Compiles run on the thread that adds the request (the caller's, or the server's compile thread), never inside
a step: a slow compile stalls nobody else. Each distinct constraint is compiled once (xgrammar's compiler caches
by content, and so do we, by :meth:`~hf_paged.structured_params.StructuredOutputsParams.key`). With a compile
budget (``structured_compile_timeout_s``), a new constraint is first tried in a killable child process
(:mod:`hf_paged.structured.compile_worker`): one over the budget is a ValueError naming it, and a caller that
gives up (its ``cancel`` event set) stops the compile.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable

from hf_paged.structured.validation import check_json_schema, xgrammar_message
from hf_paged.structured.compile_worker import CompileTimeout, CompileWorker
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
        max_entries: Compiled grammars kept (least recently used dropped first); as many over-budget verdicts
            are kept too, so a refused spec sent again is refused at once.
        compile_timeout_s: Seconds a new spec may take to compile, tried first in a child process that is killed
            past it (the engine's ``structured_compile_timeout_s``). None: compile in this process, unbounded.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], max_entries: int = 256,
                 compile_timeout_s: float | None = None) -> None:
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
        self._refused: OrderedDict[tuple[str, str], str] = OrderedDict()  # key -> the over-budget message
        self._lock = threading.Lock()
        self.num_compiles = 0
        self._json_mask = None
        self.worker = CompileWorker(self.info, compile_timeout_s) if compile_timeout_s else None

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

    def lookup(self, params: StructuredOutputsParams):
        """The cached compiled grammar of ``params``, or None; a spec refused for its compile time raises its
        ValueError again."""
        key = params.key()
        with self._lock:
            if key in self._refused:
                raise ValueError(self._refused[key])
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        return None

    def compile(self, params: StructuredOutputsParams, cancel: threading.Event | None = None):
        """The compiled grammar of ``params`` (cached); an invalid schema, regex or grammar, or one over the
        compile budget, is a ValueError. ``cancel`` set while the child compiles raises
        :class:`~hf_paged.structured.compile_worker.CompileCancelled` and stops it."""
        compiled = self.lookup(params)
        if compiled is not None:
            return compiled
        source = self._source(params)  # checks a JSON schema (jsonschema takes ~2 s on 1,000 properties): once
        if self.worker is not None and params.kind != "json_object":  # json_object: one fixed grammar
            self._try_in_child(params, source, cancel)
            compiled = self.lookup(params)  # another caller may have compiled it meanwhile
            if compiled is not None:
                return compiled
        compiled = self._compile(params, source)
        with self._lock:
            self._cache[params.key()] = compiled
            self.num_compiles += 1
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def warm(self) -> None:
        """Start the compile worker's child process now (it imports xgrammar: seconds), without waiting."""
        if self.worker is not None:
            self.worker.warm()

    def close(self) -> None:
        """Stop the compile worker's child process (if any)."""
        if self.worker is not None:
            self.worker.close()

    def _try_in_child(self, params: StructuredOutputsParams, source: tuple[str, str],
                      cancel: threading.Event | None) -> None:
        try:
            error = self.worker.check(*source, cancel)
        except CompileTimeout:
            message = (f"compiling this structured_outputs.{params.kind} took longer than "
                       f"structured_compile_timeout_s={self.worker.timeout_s:g} s, the engine's budget for one "
                       "grammar, and was stopped. Simplify it (compile time grows steeply with optional properties and string "
                       "length bounds such as maxLength) or raise the budget: PagedGenerator(..., "
                       "structured_compile_timeout_s=...) or hf-paged serve --structured-compile-timeout-s")
            with self._lock:
                self._refused[params.key()] = message
                while len(self._refused) > self.max_entries:
                    self._refused.popitem(last=False)
            raise ValueError(message) from None
        if error is not None:
            raise _invalid(params.kind, error)

    def _source(self, params: StructuredOutputsParams) -> tuple[str, str]:
        """``(method, text)``: what xgrammar compiles for ``params`` (method "json_schema", "regex" or "grammar")."""
        kind = params.kind
        if kind == "json":
            return "json_schema", json.dumps(check_json_schema(params.json))
        if kind == "json_object":
            return "json_schema", '{"type": "object"}'
        if kind == "regex":
            return "regex", params.regex
        if kind == "choice":  # literals of an EBNF rule (JSON string escapes are EBNF's)
            return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return "grammar", params.grammar

    def _compile(self, params: StructuredOutputsParams, source: tuple[str, str]):
        method, source = source
        try:
            if method == "json_schema":
                return self.compiler.compile_json_schema(source, any_whitespace=False)
            if method == "regex":
                return self.compiler.compile_regex(source)
            return self.compiler.compile_grammar(source)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for a bad spec
            raise _invalid(params.kind, str(e)) from None


def _invalid(kind: str, message: str) -> ValueError:
    return ValueError(f"invalid structured_outputs.{kind}: {xgrammar_message(message)}")


def prepare_params(cache: GrammarCompilerCache, params, cancel: threading.Event | None = None,
                   cached_only: bool = False):
    """``params`` (a :class:`~hf_paged.sampling_params.SamplingParams` or ``BeamSearchParams`` with
    ``structured_outputs``) checked for what structured output cannot combine with, and copied with its grammar
    compiled (ValueError if invalid). ``cancel``: as for :meth:`GrammarCompilerCache.compile`. ``cached_only``:
    only a cached grammar is set; without one, ``params`` come back as they are (checked)."""
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
    compiled = cache.lookup(wanted) if cached_only else cache.compile(wanted, cancel)
    if compiled is None:
        return params
    mine = dataclasses.replace(wanted)  # the engine's own copy carries the grammar; the caller's stays as given
    mine.compiled = cache.compile(wanted)
    if wanted.kind in ("json", "json_object"):
        mine.token_mask = cache.json_token_mask()
    mine.compiled = compiled
    return dataclasses.replace(params, structured_outputs=mine)
