"""Compiling a :class:`~hf_paged.structured_params.StructuredOutputsParams` into an xgrammar grammar.

Compiles run on the thread that adds the request (the caller's, or a server worker's), never inside a step:
a slow compile stalls nobody else. Each distinct constraint is compiled once (xgrammar's compiler caches by
content, and so do we, by :meth:`~hf_paged.structured_params.StructuredOutputsParams.key`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable

from hf_paged.structured_params import StructuredOutputsParams

_EXTRA_HINT = "pip install 'hf-paged[structured]'"
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")  # "[21:29:37] /project/cpp/x.cc:83: " on xgrammar errors


def import_xgrammar():
    """The ``xgrammar`` module, or an ImportError naming the extra to install."""
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(f"structured outputs need xgrammar: {_EXTRA_HINT} ({e})") from None
    return xgrammar


def check_json_schema(schema: str | dict | bool) -> dict | bool:
    """The schema as a dict, or a ValueError naming what is wrong with it (checked with ``jsonschema``)."""
    parsed = json.loads(schema) if isinstance(schema, str) else schema
    try:
        import jsonschema
    except ImportError:
        return parsed  # xgrammar still rejects what it cannot compile
    try:
        jsonschema.validators.validator_for(parsed).check_schema(parsed)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ValueError(f"invalid JSON schema at {where}: {e.message}") from None
    return parsed


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
            message = _CPP_PREFIX.sub("", str(e).strip())
            raise ValueError(f"invalid structured_outputs.{kind}: {message}") from None


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
    return dataclasses.replace(params, structured_outputs=mine)
