"""Checking a structured-output constraint when its :class:`~hf_paged.structured_params.StructuredOutputsParams`
is built, before any engine sees it.

- A JSON schema must be valid (``jsonschema``) and use only what the grammar backend enforces
  (:mod:`hf_paged.structured.schema_support`); a regex must have no construct xgrammar would ignore.
- xgrammar must build its grammar from the schema, regex or EBNF text (syntax errors surface here, not at
  ``generate()``).
- The constraint must admit some output: its grammar is compiled over a vocabulary of the 256 single bytes and
  its first step must allow one (``[^\\s\\S]`` allows none). A constraint that dies later (``a[^\\s\\S]``) is
  caught at the step where it allows no token (:mod:`hf_paged.structured.matchers`).

xgrammar imports torch, so :mod:`hf_paged.structured_params` imports this module only when a constraint is built.
Without xgrammar, the pure-Python checks still run; the engine then raises the ImportError naming the extra.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

from hf_paged.structured.regex_support import unsupported_regex_construct
from hf_paged.structured.schema_support import check_schema_support

_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")  # "[21:29:37] /project/cpp/x.cc:83: " on xgrammar errors
_CHECKED_MAX = 512
_checked: OrderedDict[tuple[str, str], None] = OrderedDict()  # keys of constraints that passed (LRU)
_lock = threading.Lock()
_byte_compiler = None


def xgrammar_message(error: Exception) -> str:
    """An xgrammar exception's message without its C++ source prefix."""
    return _CPP_PREFIX.sub("", str(error).strip())


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


def check_constraint(params) -> None:
    """Raise ValueError if the constraint of ``params`` (a StructuredOutputsParams) is invalid, uses something the
    grammar backend would not enforce, or admits no output. Constraints that passed are remembered by key."""
    key = params.key()
    with _lock:
        if key in _checked:
            _checked.move_to_end(key)
            return
    kind = params.kind
    if kind in ("json_object", "choice"):
        return  # built by us: always valid and never empty
    if kind == "json":
        schema = check_json_schema(params.json)
        check_schema_support(schema)
    elif kind == "regex":
        problem = unsupported_regex_construct(params.regex)
        if problem is not None:
            raise ValueError(f"structured_outputs.regex has {problem}: the grammar backend (xgrammar) would not "
                             "enforce it")
    grammar = _build(params)  # xgrammar's own refusals (cheap: the grammar, not its token masks)
    if grammar is not None and kind != "json":
        # Compiling even over 256 bytes costs what compiling over the vocabulary does for big JSON schemas (20 s
        # for 1,500 optional properties), in the caller's thread and unstoppable: JSON schemas are left to the
        # engine's compile budget, and one that admits no output fails at its first step, naming the constraint.
        _check_not_empty(grammar, kind)
    with _lock:
        _checked[key] = None
        while len(_checked) > _CHECKED_MAX:
            _checked.popitem(last=False)


def _build(params):
    """xgrammar's Grammar of the constraint (a ValueError if xgrammar refuses it), or None without xgrammar."""
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    kind = params.kind
    try:
        if kind == "json":
            text = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return xgr.Grammar.from_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        return xgr.Grammar.from_ebnf(params.grammar)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for a bad spec
        raise ValueError(f"invalid structured_outputs.{kind}: {xgrammar_message(e)}") from None


def _check_not_empty(grammar, kind: str) -> None:
    """A grammar whose first step allows no byte (and that cannot end there) matches nothing: refuse it."""
    import xgrammar as xgr

    global _byte_compiler
    with _lock:
        if _byte_compiler is None:
            vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
            info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[256])
            _byte_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    matcher = xgr.GrammarMatcher(_byte_compiler.compile_grammar(grammar))
    bitmask = xgr.allocate_token_bitmask(1, 257)
    matcher.fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()):
        raise ValueError(f"structured_outputs.{kind} can match nothing: no output satisfies it (an empty "
                         "character class such as [^\\s\\S], or a rule that never ends)")
