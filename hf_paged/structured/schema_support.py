"""What the grammar backend (xgrammar 0.2) enforces of a JSON schema or a regex, and a check that refuses the rest.

xgrammar turns a schema into a grammar, but it silently drops much of JSON Schema: ``not``, ``if``/``then``/
``else``, ``uniqueItems``, ``contains`` and the ``dependent*`` keywords are read by nobody; a schema with ``$ref``,
``const``, ``enum``, ``anyOf``, ``oneOf`` or ``allOf`` is generated from that one keyword, its siblings ignored;
``allOf`` with several schemas and remote ``$ref`` become "any JSON value"; ``oneOf`` whose branches may overlap
becomes ``anyOf``; a keyword of one type in a schema without ``"type"`` (``{"minimum": 3}``) allows any value;
``required`` names outside ``properties`` are never generated. Each of those answers outputs that break the schema
while looking successful, so :func:`check_schema_support` refuses them (a :class:`UnsupportedSchemaError`
naming the keyword and its JSON pointer). What it lets through is enforced (tested by generating and
validating with ``jsonschema``).

Pure Python: importing this module loads neither xgrammar nor torch.
"""

from __future__ import annotations

import re

from hf_paged.structured.regex_support import unescaped_json_hazard, unsupported_regex_construct

# Keywords that never reject a value (JSON Schema annotations and structure). ``format`` is an annotation in
# JSON Schema unless a validator opts in; xgrammar enforces the formats in BUILTIN_FORMATS on strings.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment", "$schema",
    "$id", "$anchor", "$dynamicAnchor", "$vocabulary", "$defs", "definitions", "format", "contentEncoding",
    "contentMediaType", "contentSchema",
})
BUILTIN_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri", "uri-reference",
    "uri-template", "json-pointer", "relative-json-pointer",
})
# Keywords xgrammar never reads: refused wherever they appear in a schema the grammar is built from.
NEVER_ENFORCED = {
    "not": "xgrammar cannot exclude values",
    "if": "conditional schemas are not supported",
    "then": "conditional schemas are not supported",
    "else": "conditional schemas are not supported",
    "dependentRequired": "dependencies between properties are not supported",
    "dependentSchemas": "dependencies between properties are not supported",
    "dependencies": "dependencies between properties are not supported",
    "contains": "xgrammar cannot require an item matching a schema",
    "minContains": "xgrammar cannot count items matching a schema",
    "maxContains": "xgrammar cannot count items matching a schema",
    "additionalItems": "use prefixItems and items (JSON Schema 2020-12)",
    "$dynamicRef": "only local references '#/...' are supported",
    "$recursiveRef": "only local references '#/...' are supported",
}
# Keywords that constrain a value of one JSON type: without "type" xgrammar generates any value for them.
TYPED_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
                  "maxLength", "pattern", "required", "minProperties", "maxProperties", "patternProperties",
                  "propertyNames", "minItems", "maxItems")
OBJECT_DISPATCH = ("properties", "additionalProperties", "unevaluatedProperties")  # these alone make an object
ARRAY_DISPATCH = ("items", "prefixItems", "unevaluatedItems")  # and these an array
# Every keyword that can reject a value: next to $ref / const / enum / anyOf / oneOf / allOf, xgrammar ignores it.
ASSERTING = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxProperties", "minProperties",
    "required", "allOf", "anyOf", "oneOf", "prefixItems", "items", "properties", "patternProperties",
    "additionalProperties", "propertyNames", "unevaluatedItems", "unevaluatedProperties", "$ref", *NEVER_ENFORCED,
})
INTEGER_MULTIPLE_OF_MAX = 1024  # xgrammar's bounds for an enforced integer multipleOf
INTEGER_RANGE_WITH_MULTIPLE_OF_MAX = 10000


class UnsupportedSchemaError(ValueError):
    """A JSON-schema keyword (or a regex construct) the grammar backend would not enforce.

    Attributes:
        keyword: The refused keyword, e.g. ``"uniqueItems"``.
        path: JSON pointer of the keyword in the schema, e.g. ``"#/properties/tags/uniqueItems"``.
    """

    def __init__(self, keyword: str, path: str, reason: str) -> None:
        super().__init__(f"JSON schema keyword {keyword!r} at {path} is not enforced by the grammar backend "
                         f"(xgrammar): {reason}")
        self.keyword = keyword
        self.path = path


def pointer(path: str, *tokens: object) -> str:
    """``path`` extended by JSON-pointer ``tokens`` (escaped: ``~`` as ``~0``, ``/`` as ``~1``)."""
    return path + "".join("/" + str(t).replace("~", "~0").replace("/", "~1") for t in tokens)


def check_schema_support(schema: dict | bool) -> None:
    """Raise :class:`UnsupportedSchemaError` for the first part of ``schema`` (a valid JSON schema) that xgrammar
    would not enforce; return if every keyword it generates from is enforced."""
    _Walker(schema).walk(schema, "#")


class _Walker:
    """Walks the subschemas xgrammar builds its grammar from (following local ``$ref``), the way it reads them."""

    def __init__(self, root: dict | bool) -> None:
        self.root = root
        self.seen: set[tuple[int, str | None]] = set()

    def walk(self, schema: object, path: str, default_type: str | None = None) -> None:
        if not isinstance(schema, dict) or (id(schema), default_type) in self.seen:
            return  # true is any value; false and non-schemas are xgrammar's (loud) errors
        self.seen.add((id(schema), default_type))
        for keyword, reason in NEVER_ENFORCED.items():
            if keyword in schema:
                raise UnsupportedSchemaError(keyword, pointer(path, keyword), reason)
        if schema.get("uniqueItems") is True:
            raise UnsupportedSchemaError("uniqueItems", pointer(path, "uniqueItems"),
                                         "xgrammar cannot keep array items distinct")
        if "$id" in schema and path != "#":
            raise UnsupportedSchemaError("$id", pointer(path, "$id"), "only the root schema may have an $id "
                                         "(xgrammar resolves every '#/...' reference from the root)")
        # xgrammar generates from the first of these a schema has, and ignores its other keywords
        for keyword in ("$ref", "const", "enum", "anyOf", "oneOf", "allOf"):
            if keyword in schema:
                return self._by_keyword(schema, keyword, path)
        self._typed(schema, path, default_type)

    def _by_keyword(self, schema: dict, keyword: str, path: str) -> None:
        if keyword in ("const", "enum"):
            return self._finite(schema, keyword, path)  # the output is one of the values: each must be valid
        ignored = sorted(k for k in schema if k != keyword and k in ASSERTING)
        if ignored:
            raise UnsupportedSchemaError(ignored[0], pointer(path, ignored[0]),
                                         f"xgrammar ignores it next to {keyword!r}; move it into the {keyword} "
                                         f"schema{'s' if keyword != '$ref' else ''}")
        if keyword == "$ref":
            target, where = self._resolve(schema["$ref"], pointer(path, "$ref"))
            return self.walk(target, where)
        options = schema[keyword]
        if not isinstance(options, list):
            return  # not a valid schema: jsonschema and xgrammar refuse it
        if keyword == "allOf" and len(options) != 1:
            raise UnsupportedSchemaError("allOf", pointer(path, "allOf"), f"with {len(options)} schemas xgrammar "
                                         "allows any JSON value (it enforces allOf of one schema); merge them")
        if keyword == "oneOf":
            self._check_disjoint(options, pointer(path, "oneOf"))
        for i, option in enumerate(options):
            self.walk(option, pointer(path, keyword, i))

    def _resolve(self, ref: object, path: str) -> tuple[object, str]:
        if not isinstance(ref, str):
            return None, path  # xgrammar refuses it
        if ref == "#":
            return self.root, "#"
        if not ref.startswith("#/"):
            raise UnsupportedSchemaError("$ref", path, f"{ref!r} is not a local reference: only '#' and '#/...' "
                                         "(to a part of this schema, e.g. '#/$defs/Item') are supported")
        target: object = self.root
        for part in ref[2:].split("/"):  # as xgrammar walks it (no ~0 / ~1 / %-unescaping)
            if not part:
                continue
            if not isinstance(target, dict) or part not in target:
                raise UnsupportedSchemaError("$ref", path, f"{ref!r} points to nothing in this schema")
            target = target[part]
        return target, ref

    def _finite(self, schema: dict, keyword: str, path: str) -> None:
        values = [schema["const"]] if keyword == "const" else schema["enum"]
        if not isinstance(values, list):
            return
        rest = {k: v for k, v in schema.items() if k in ASSERTING and k not in ("const", "enum")}
        if not rest:
            return
        for i, value in enumerate(values):
            problem = self._invalid_under(value, schema)
            if problem is not None:
                broken = problem[0] if problem[0] in rest else sorted(rest)[0]
                where = pointer(path, keyword) if keyword == "const" else pointer(path, "enum", i)
                raise UnsupportedSchemaError(broken, pointer(path, broken), f"xgrammar outputs one of the {keyword} "
                                             f"values and ignores the other keywords, but the value at {where} "
                                             f"breaks them ({problem[1]})")

    def _invalid_under(self, value: object, schema: dict) -> tuple[str, str] | None:
        """(the keyword, why) ``value`` is not valid under the subschema ``schema`` (refs resolved from the root),
        or None if it is valid."""
        try:
            import jsonschema
        except ImportError:  # without jsonschema only "type" next to const / enum can be checked
            others = sorted(k for k in schema if k in ASSERTING and k not in ("const", "enum", "type"))
            if others:
                return others[0], "it cannot be checked without the jsonschema package"
            types = schema.get("type")
            types = [types] if isinstance(types, str) else types
            ok = types is None or any(json_type_matches(value, t) for t in types)
            return None if ok else ("type", f"{value!r} is not of type {schema.get('type')!r}")
        root = self.root if isinstance(self.root, dict) else {}
        validator = jsonschema.validators.validator_for(root)(root).evolve(schema=schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        if error is None:
            return None
        keyword = next((str(p) for p in error.relative_schema_path if str(p) in schema), str(error.validator))
        return keyword, error.message

    def _check_disjoint(self, options: list, path: str) -> None:
        """xgrammar generates oneOf as anyOf unless it proves the branches disjoint: an output may then match two
        branches. Refuse unless every pair of branches provably accepts no common value."""
        facts = [self._facts(option) for option in options]
        for i in range(len(facts)):
            for j in range(i + 1, len(facts)):
                if not _disjoint(facts[i], facts[j]):
                    raise UnsupportedSchemaError("oneOf", path, f"branches {i} and {j} may both match one value, "
                                                 "and xgrammar then generates oneOf as anyOf; make the branches "
                                                 "disjoint (different types, const/enum values, or a required "
                                                 "property with different const values) or use anyOf")

    def _facts(self, schema: object, depth: int = 0) -> dict:
        """What is known of every value valid under ``schema``: its JSON types, its finite values, and (objects)
        required properties with finite values."""
        if isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < 32:
            try:
                target, _ = self._resolve(schema["$ref"], "#")
            except UnsupportedSchemaError:
                return {}
            return self._facts(target, depth + 1)
        if not isinstance(schema, dict):
            return {}
        facts: dict = {}
        if "const" in schema:
            facts["values"] = [schema["const"]]
        elif isinstance(schema.get("enum"), list):
            facts["values"] = schema["enum"]
        types = schema.get("type")
        if isinstance(types, str) or (isinstance(types, list) and types):
            facts["types"] = {types} if isinstance(types, str) else set(types)
        if facts.get("types") == {"object"} and isinstance(schema.get("properties"), dict):
            required = schema.get("required") if isinstance(schema.get("required"), list) else []
            tags = {}
            for name in required:
                sub = self._facts(schema["properties"].get(name), depth + 1)
                if "values" in sub:
                    tags[name] = sub["values"]
            facts["tags"] = tags
        return facts

    def _typed(self, schema: dict, path: str, default_type: str | None) -> None:
        types = schema.get("type", default_type)
        if types is None:
            if any(k in schema for k in OBJECT_DISPATCH):
                types = "object"
            elif any(k in schema for k in ARRAY_DISPATCH):
                types = "array"
            else:
                for keyword in TYPED_KEYWORDS:
                    if keyword in schema:
                        raise UnsupportedSchemaError(keyword, pointer(path, keyword), 'without a "type" xgrammar '
                                                     'allows any JSON value here; add "type"')
                return
        for kind in [types] if isinstance(types, str) else types:
            if kind == "string":
                self._string(schema, path)
            elif kind in ("integer", "number"):
                _number(schema, path, kind)
            elif kind == "object":
                self._object(schema, path)
            elif kind == "array":
                self._array(schema, path)

    def _string(self, schema: dict, path: str) -> None:
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            problem = unsupported_regex_construct(pattern) or unescaped_json_hazard(pattern)
            if problem is not None:
                raise UnsupportedSchemaError("pattern", pointer(path, "pattern"), f"its regex has {problem}")
        generative = "pattern" if pattern is not None else "format" if schema.get("format") in BUILTIN_FORMATS \
            else None
        for keyword in ("minLength", "maxLength"):
            if generative and keyword in schema:
                raise UnsupportedSchemaError(keyword, pointer(path, keyword), f"xgrammar ignores it next to "
                                             f"{generative!r}; put the length into the pattern")

    def _object(self, schema: dict, path: str) -> None:
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        patterns = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        for i, name in enumerate(required):
            if name not in properties:
                raise UnsupportedSchemaError("required", pointer(path, "required", i), f"{name!r} is not in "
                                             "properties, and xgrammar generates only the listed properties as "
                                             "required ones; add it to properties")
        if len(patterns) > 1:
            raise UnsupportedSchemaError("patternProperties", pointer(path, "patternProperties"),
                                         "with several patterns a key may match two of them; use one pattern")
        for regex, sub in patterns.items():
            where = pointer(path, "patternProperties", regex)
            problem = unsupported_regex_construct(regex) or unescaped_json_hazard(regex)
            try:
                overlap = [name for name in properties if re.search(regex, name)]
            except re.error as e:
                problem = problem or f"a regex that cannot be checked against the property names ({e})"
                overlap = []
            if problem or overlap:
                raise UnsupportedSchemaError("patternProperties", where, problem or f"it matches the property "
                                             f"{overlap[0]!r}, whose value xgrammar then checks only against "
                                             "properties")
            self.walk(sub, where)
        if "propertyNames" in schema and (properties or patterns):
            raise UnsupportedSchemaError("propertyNames", pointer(path, "propertyNames"), "xgrammar does not apply "
                                         "it to the names in properties and patternProperties")
        for name, sub in properties.items():
            self.walk(sub, pointer(path, "properties", name))
        self.walk(schema.get("propertyNames"), pointer(path, "propertyNames"), default_type="string")
        for keyword in ("additionalProperties", "unevaluatedProperties"):
            self.walk(schema.get(keyword), pointer(path, keyword))
        extra = schema.get("additionalProperties", schema.get("unevaluatedProperties", False))
        minimum = schema.get("minProperties")
        if (extra is not False or patterns or "propertyNames" in schema) and isinstance(minimum, int) \
                and minimum > len(required):
            raise UnsupportedSchemaError("minProperties", pointer(path, "minProperties"), "xgrammar may repeat a "
                                         "key that is not required, which counts once; require the properties")

    def _array(self, schema: dict, path: str) -> None:
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        for i, sub in enumerate(prefix):
            self.walk(sub, pointer(path, "prefixItems", i))
        keyword = "items" if "items" in schema else "unevaluatedItems"
        self.walk(schema.get(keyword), pointer(path, keyword))


def _number(schema: dict, path: str, kind: str) -> None:
    step = schema.get("multipleOf")
    if step is None or isinstance(step, bool) or not isinstance(step, (int, float)):
        return
    where = pointer(path, "multipleOf")
    if kind == "number":
        raise UnsupportedSchemaError("multipleOf", where, 'xgrammar enforces it only with "type": "integer"')
    if step != int(step) or step > INTEGER_MULTIPLE_OF_MAX:
        raise UnsupportedSchemaError("multipleOf", where, f"xgrammar enforces only a whole multipleOf up to "
                                     f"{INTEGER_MULTIPLE_OF_MAX}")
    low, high = _integer_range(schema)
    bounded = low is not None or high is not None
    if bounded and (low is None or high is None or high - low + 1 > INTEGER_RANGE_WITH_MULTIPLE_OF_MAX):
        raise UnsupportedSchemaError("multipleOf", where, "xgrammar enforces it with no bounds, or with both a "
                                     f"lower and an upper bound at most {INTEGER_RANGE_WITH_MULTIPLE_OF_MAX} "
                                     "integers apart")


def _integer_range(schema: dict) -> tuple[float | None, float | None]:
    def num(key: str) -> float | None:
        value = schema.get(key)
        return None if isinstance(value, bool) or not isinstance(value, (int, float)) else value

    lows = [v for v in (num("minimum"), None if num("exclusiveMinimum") is None else num("exclusiveMinimum") + 1)
            if v is not None]
    highs = [v for v in (num("maximum"), None if num("exclusiveMaximum") is None else num("exclusiveMaximum") - 1)
             if v is not None]
    return (max(lows) if lows else None), (min(highs) if highs else None)


def json_type_matches(value: object, kind: str) -> bool:
    """Whether ``value`` (parsed JSON) is of JSON-schema type ``kind`` (an integral float is an integer)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {"null": value is None, "boolean": isinstance(value, bool), "string": isinstance(value, str),
            "number": number, "integer": number and float(value).is_integer(),
            "array": isinstance(value, list), "object": isinstance(value, dict)}.get(kind, False)


def _canonical(value: object) -> object:
    """A hashable form under which two JSON values are equal exactly when JSON Schema calls them equal."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, (int, float)):
        return ("number", value)
    if isinstance(value, list):
        return ("array", tuple(_canonical(v) for v in value))
    if isinstance(value, dict):
        return ("object", tuple(sorted((k, _canonical(v)) for k, v in value.items())))
    return ("other", repr(value))


def _types_overlap(a: set, b: set) -> bool:
    numeric = {"integer", "number"}
    return bool(a & b) or bool(a & numeric and b & numeric)


def _values_disjoint(a: list, b: list) -> bool:
    return not {_canonical(v) for v in a} & {_canonical(v) for v in b}


def _disjoint(a: dict, b: dict) -> bool:
    """Whether no value can be valid under two schemas of which these facts are known (see ``_facts``)."""
    if "values" in a and "values" in b and _values_disjoint(a["values"], b["values"]):
        return True
    for x, y in ((a, b), (b, a)):
        if "values" in x and "types" in y and not any(json_type_matches(v, t) for v in x["values"] for t in y["types"]):
            return True
    if "types" in a and "types" in b and not _types_overlap(a["types"], b["types"]):
        return True
    shared = set(a.get("tags", ())) & set(b.get("tags", ()))
    return any(_values_disjoint(a["tags"][k], b["tags"][k]) for k in shared)
