"""Regex constructs the grammar backend (xgrammar 0.2) would not enforce, found before it sees the regex.

xgrammar matches a whole output, so ``^`` and ``$`` mean something only at the very start and end; elsewhere it
drops them (``a$b`` would give "ab"). It drops lookaheads inside JSON-schema patterns, matches an unknown escape
such as ``\\A`` or ``\\z`` as the letter itself, and in a JSON-schema pattern writes a ``"`` or backslash the
pattern names into the JSON string unescaped. Pure Python.
"""

from __future__ import annotations

import re

# Regex escapes xgrammar reads (the letters and digits; any other letter is matched as itself, with a warning).
KNOWN_ESCAPES = frozenset("abcdefknprstuvwxBDPSW0123456789")


def unsupported_regex_construct(regex: str) -> str | None:
    """A regex construct xgrammar would ignore (so the output could break the regex), described; None if none.

    xgrammar matches a whole output, so ``^`` and ``$`` mean something only at the very start and end; elsewhere
    it drops them (``a$b`` would give "ab"). It drops lookaheads ``(?=..)`` / ``(?!..)`` inside JSON-schema
    patterns, and matches an unknown escape such as ``\\A`` or ``\\z`` as the letter itself.
    """
    i, n, in_class = 0, len(regex), False
    while i < n:
        c = regex[i]
        if c == "\\":
            nxt = regex[i + 1] if i + 1 < n else ""
            if nxt.isascii() and nxt.isalnum() and nxt not in KNOWN_ESCAPES:
                return f"the escape \\{nxt} at position {i + 1} (xgrammar would match the letter {nxt!r})"
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "^" and i != 0:
            return f"'^' at position {i + 1}, not at the start (xgrammar would drop it)"
        elif c == "$" and i != n - 1:
            return f"'$' at position {i + 1}, not at the end (xgrammar would drop it)"
        elif regex.startswith(("(?=", "(?!"), i):
            return f"the lookahead at position {i + 1} (xgrammar would drop it)"
        i += 1
    return None


_QUOTE_OR_BACKSLASH = re.compile(r'"|\\\\|\\x(22|5[cC])|\\u00(22|5[cC])')


def unescaped_json_hazard(regex: str) -> str | None:
    """Where a JSON-schema pattern names '"' or a backslash itself (a literal, ``\\\\``, ``\\x22``, ...)
    outside a negated class: xgrammar writes such a character into the JSON string unescaped, which ends the
    string early or breaks the JSON. None if there is no such place."""
    i, n, negated = 0, len(regex), None  # negated: None outside a class, else whether the class is [^...]
    while i < n:
        if negated is not True:
            hit = _QUOTE_OR_BACKSLASH.match(regex, i)
            if hit:
                return f"{hit.group(0)!r} at position {i + 1} (xgrammar would write it unescaped into the JSON string)"
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if negated is None and c == "[":
            negated = regex.startswith("^", i + 1)
            i += 2 if negated else 1
            continue
        if negated is not None and c == "]":
            negated = None
        i += 1
    return None
