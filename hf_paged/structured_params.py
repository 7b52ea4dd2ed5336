"""What a structured-output request constrains its output to (pure Python: the scheduling layer reads it).

Building one checks the constraint (:mod:`hf_paged.structured.validation`, imported lazily: it loads xgrammar);
the grammar itself is compiled by :mod:`hf_paged.structured` when the engine admits the request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# How the error of a request whose constraint turned out to admit no output starts (the server answers 400)
CONSTRAINT_ERROR = "invalid structured output constraint"


def dead_end_message(kind: str, generated: int) -> str:
    """Why a sequence whose grammar allows no next token failed (the constraint's fault, not the model's)."""
    return (f"{CONSTRAINT_ERROR}: structured_outputs.{kind} allows no token after {generated} generated "
            "token(s) and cannot end there, so no output satisfies it (e.g. an empty character class such as "
            "[^\\s\\S], or a rule that never ends)")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names); set exactly one of the fields.

    Args:
        json: A JSON schema (a dict or its JSON text): the output is a JSON value valid under it.
        json_object: True: the output is any JSON object.
        regex: The output matches this regular expression (whole output).
        choice: The output is exactly one of these strings.
        grammar: An EBNF grammar (xgrammar / GBNF syntax, start rule ``root``).

    Example:
        >>> StructuredOutputsParams(choice=["yes", "no"]).kind
        'choice'
    """

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # the engine's compiled grammar (set on the engine's own copy at admission, never by users)
    compiled: Any = field(default=None, init=False, repr=False, compare=False)
    # JSON output: the tokens it may ever contain, an int32 bitmask (none with a raw control character, which
    # JSON never has; xgrammar's length-bounded strings would allow them), set on the engine's copy
    token_mask: Any = field(default=None, init=False, repr=False, compare=False)
    # beam search: the search's stop tokens end the grammar (its beams never stop by themselves)
    stop_token_ids: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise TypeError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), got {self.json!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"structured_outputs.{name} must be a non-empty str, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not hasattr(self.choice, "__iter__"):
                raise TypeError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}")
        # the constraint itself (schema keywords, regex, grammar, emptiness) is checked now, not at generate();
        # that module loads xgrammar (and with it torch), so only when a constraint is built
        from hf_paged.structured.validation import check_constraint

        check_constraint(self)

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """A hashable identity of the constraint (the compile cache's key)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(value)
        return kind, str(value)

    @classmethod
    def from_value(cls, value: object) -> StructuredOutputsParams:
        """A :class:`StructuredOutputsParams`, or a dict of its fields."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            allowed = {f.name for f in fields(cls) if f.init}
            unknown = sorted(set(value) - allowed)
            if unknown:
                raise ValueError(f"unknown structured_outputs field(s) {unknown}; allowed: {sorted(allowed)}")
            return cls(**value)
        raise TypeError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}")
