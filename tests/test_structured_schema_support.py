"""What the grammar backend (xgrammar) enforces of a JSON schema: the rest is refused by name when the
constraint is built, and what is accepted holds in generated outputs (validated with ``jsonschema``).

Each refused case below was checked against xgrammar 0.2.8: compiled as given, it answers outputs that break
the schema (random walks of its grammar, validated with ``jsonschema``), mostly without any warning.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from hf_paged import PagedGenerator, SamplingParams  # noqa: E402
from hf_paged.structured.schema_support import UnsupportedSchemaError, check_schema_support  # noqa: E402
from hf_paged.structured_params import StructuredOutputsParams  # noqa: E402
from tests.serving_helpers import default_tokenizer, tiny_chat_model  # noqa: E402

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# (schema, the refused keyword, its JSON pointer): nested ones inside properties, items, anyOf, $defs (via $ref)
REFUSED = [
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf", "#/allOf"),
    ({"type": "object", "properties": {"x": {"allOf": [OBJ, {"type": "object"}]}}}, "allOf", "#/properties/x/allOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "#/uniqueItems"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "array", "uniqueItems": True}}}},
     "uniqueItems", "#/properties/tags/items/uniqueItems"),
    ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "if", "#/if"),
    ({"type": "object", "properties": {"a": {"then": {"minimum": 3}}}}, "then", "#/properties/a/then"),
    ({"anyOf": [{"type": "integer"}, {"else": {"type": "string"}}]}, "else", "#/anyOf/1/else"),
    ({"not": {"type": "integer"}}, "not", "#/not"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "integer"}}]}, "not", "#/anyOf/1/not"),
    ({"$ref": "http://example.com/schema.json"}, "$ref", "#/$ref"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"$ref": "other.json#/B"}}},
     "$ref", "#/$defs/A/$ref"),
    ({"$ref": "#/$defs/missing", "$defs": {}}, "$ref", "#/$ref"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains", "#/contains"),
    ({"type": "array", "minContains": 2}, "minContains", "#/minContains"),
    ({"type": "array", "maxContains": 2}, "maxContains", "#/maxContains"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "#/dependentRequired"),
    ({"type": "object", "dependentSchemas": {"a": OBJ}}, "dependentSchemas", "#/dependentSchemas"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "dependencies": {"a": ["b"]}},
     "dependencies", "#/dependencies"),
    ({"type": "array", "additionalItems": False}, "additionalItems", "#/additionalItems"),
    ({"$dynamicRef": "#node"}, "$dynamicRef", "#/$dynamicRef"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "#/multipleOf"),
    ({"type": "integer", "multipleOf": 7, "minimum": 0}, "multipleOf", "#/multipleOf"),
    ({"type": "integer", "multipleOf": 2048}, "multipleOf", "#/multipleOf"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength", "#/maxLength"),
    ({"type": "string", "format": "date", "minLength": 20}, "minLength", "#/minLength"),
    ({"type": "string", "pattern": "a$b"}, "pattern", "#/pattern"),
    ({"type": "string", "pattern": "\\Aab"}, "pattern", "#/pattern"),
    ({"type": "string", "pattern": "(?=a)[a-z]"}, "pattern", "#/pattern"),
    ({"type": "string", "pattern": '^say "hi"$'}, "pattern", "#/pattern"),  # xgrammar writes the quote raw
    ({"type": "object", "propertyNames": {"pattern": "^[\\\\]$"}, "maxProperties": 1}, "pattern",
     "#/propertyNames/pattern"),
    ({"$ref": "#/$defs/N", "maximum": 3, "$defs": {"N": {"type": "integer"}}}, "maximum", "#/maximum"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}, "properties",
     "#/properties"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}], "maxLength": 2}, "maxLength", "#/maxLength"),
    ({"type": "integer", "const": "s"}, "type", "#/type"),
    ({"type": "string", "enum": ["a", 1]}, "type", "#/type"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "#/oneOf"),
    ({"type": "array", "items": {"oneOf": [{"enum": ["a", "b"]}, {"enum": ["b", "c"]}]}}, "oneOf", "#/items/oneOf"),
    ({"minimum": 5}, "minimum", "#/minimum"),
    ({"type": "array", "items": {"required": ["a"]}}, "required", "#/items/required"),
    ({"type": "object", "required": ["a"]}, "required", "#/required/0"),
    ({"type": "object", "properties": {"b": {"type": "null"}}, "required": ["b", "a"], "additionalProperties": True},
     "required", "#/required/1"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "patternProperties": {"^a": {"type": "integer"}}},
     "patternProperties", "#/patternProperties/^a"),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "string"}}},
     "patternProperties", "#/patternProperties"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "propertyNames": {"pattern": "^b"}}, "propertyNames",
     "#/propertyNames"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, "minProperties",
     "#/minProperties"),
    ({"type": "object", "properties": {"a/b": {"type": "array", "uniqueItems": True}}}, "uniqueItems",
     "#/properties/a~1b/uniqueItems"),
    ({"type": "object", "properties": {"a": {"$id": "https://example.com/a", "type": "integer"}}}, "$id",
     "#/properties/a/$id"),
]
# Enforced (compiled as given, every output validates); bounded so that a random model finishes them.
SUPPORTED = [
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "string", "pattern": "^[a-c]{2}-[0-9]$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"type": "integer", "minimum": -5, "maximum": 40, "multipleOf": 3},
    {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 9},
    {"type": "boolean"},
    {"type": ["string", "null"], "maxLength": 3},
    {"enum": ["red", 2, None, {"k": [True]}]},
    {"type": "string", "enum": ["x", "y"], "title": "annotations are fine"},
    {"const": {"k": "v"}},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 2}]},
    {"oneOf": [{"type": "boolean"}, {"type": "string", "maxLength": 3}]},
    {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "$defs": {
        "Cat": {"type": "object", "properties": {"pet": {"const": "cat"}, "lives": {"type": "integer", "minimum": 0,
                                                                                    "maximum": 9}},
                "required": ["pet", "lives"], "additionalProperties": False},
        "Dog": {"type": "object", "properties": {"pet": {"const": "dog"}, "good": {"type": "boolean"}},
                "required": ["pet", "good"], "additionalProperties": False}}},
    {"allOf": [{"type": "integer", "minimum": 1, "maximum": 3}], "description": "one schema"},
    {"$ref": "#/$defs/Node", "$defs": {"Node": {"type": "object", "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 1}},
        "required": ["v", "kids"], "additionalProperties": False}}},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "null"}], "items": {"type": "integer",
                                                                                       "minimum": 0, "maximum": 5},
     "minItems": 3, "maxItems": 4},
    {"type": "object", "properties": {"a": {"type": "null"}}, "required": ["a"],
     "additionalProperties": {"type": "boolean"}, "maxProperties": 2},
    {"type": "object", "patternProperties": {"^x[0-9]$": {"type": "boolean"}}, "maxProperties": 1},
    {"type": "object", "propertyNames": {"pattern": "^[a-c]{1,2}$"}, "additionalProperties": {"type": "null"},
     "maxProperties": 1},
    {"type": "object", "properties": {"a": {"type": "null"}}, "unevaluatedProperties": {"type": "boolean"},
     "maxProperties": 2},
    {"properties": {"n": {"type": "integer", "minimum": 1, "maximum": 2}}, "required": ["n"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 2}},
                                            "required": ["q"], "additionalProperties": False}},
     "required": ["p"], "additionalProperties": False},
]


@pytest.mark.parametrize(("schema", "keyword", "path"), REFUSED, ids=[f"{k}@{p}" for _, k, p in REFUSED])
def test_refused_keywords_are_value_errors_naming_keyword_and_path(schema, keyword, path):
    jsonschema.validators.validator_for(schema).check_schema(schema)  # every one is a valid schema
    with pytest.raises(UnsupportedSchemaError) as caught:
        check_schema_support(schema)
    assert (caught.value.keyword, caught.value.path) == (keyword, path)
    # refused when the params are built (not at generate()), as a ValueError naming both
    with pytest.raises(ValueError, match=re.escape(f"{keyword!r} at {path}")):
        SamplingParams(structured_outputs={"json": schema})
    with pytest.raises(ValueError, match="not enforced"):
        StructuredOutputsParams(json=json.dumps(schema))


@pytest.mark.parametrize("schema", SUPPORTED, ids=range(len(SUPPORTED)))
def test_supported_keywords_are_accepted(schema):
    check_schema_support(schema)
    StructuredOutputsParams(json=schema)


def test_invalid_constraints_raise_when_the_params_are_built():
    """Before: a malformed schema, regex or grammar raised only at generate()."""
    with pytest.raises(ValueError, match="invalid JSON schema"):
        SamplingParams(structured_outputs={"json": {"type": "foo"}})
    with pytest.raises(ValueError, match="parenthesis is not closed"):
        StructuredOutputsParams(regex="a(b")
    with pytest.raises(ValueError, match='root rule with name "root" is not found'):
        StructuredOutputsParams(grammar='start ::= "a"')
    with pytest.raises(ValueError, match="minItems is greater"):  # xgrammar's own refusal, now at build time
        StructuredOutputsParams(json={"type": "array", "prefixItems": [{"type": "null"}], "minItems": 2})
    for regex, what in ((r"\d+\z", r"escape \z"), ("a^b", "'^' at position 2"), ("a$b", "'$' at position 2")):
        with pytest.raises(ValueError, match=re.escape(what)):
            StructuredOutputsParams(regex=regex)


@pytest.mark.parametrize("kind", [{"regex": r"[^\s\S]"}, {"regex": r"([^\s\S])+"},
                                  {"grammar": 'root ::= x\nx ::= x "b"'}])
def test_a_constraint_that_matches_nothing_is_refused_when_built(kind):
    name = next(iter(kind))
    with pytest.raises(ValueError, match=f"structured_outputs.{name} can match nothing"):
        SamplingParams(structured_outputs=kind)


def test_refusal_needs_neither_torch_nor_xgrammar():
    """The keyword check is pure Python: a refused schema is refused before xgrammar (and torch) is imported."""
    code = (
        "import sys\n"
        "from hf_paged.structured_params import StructuredOutputsParams\n"
        "try:\n"
        "    StructuredOutputsParams(json={'type': 'array', 'uniqueItems': True})\n"
        "except ValueError as e:\n"
        "    assert 'uniqueItems' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('not refused')\n"
        "bad = [m for m in ('torch', 'xgrammar', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def engine():
    tok = default_tokenizer()
    with PagedGenerator(tiny_chat_model(tok), tok, max_num_seqs=64, block_size=4, num_blocks=3000) as eng:
        yield eng


def test_supported_keywords_hold_in_generated_outputs(engine):
    """A tiny random model under each supported schema: every finished output is valid under it, and each
    schema finishes some (its outputs are bounded)."""
    samples = 3
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=10 * i, n=samples,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for i, schema in enumerate(SUPPORTED)]
    outs = engine.generate(["Give me JSON"] * len(SUPPORTED), params, use_tqdm=False)
    for schema, out in zip(SUPPORTED, outs):
        finished = [c for c in out.outputs if c.finish_reason == "stop"]
        assert finished, (schema, [c.text for c in out.outputs])
        for c in finished:
            jsonschema.validate(json.loads(c.text), schema)
    assert engine.kv_manager.num_used_blocks == 0


def test_json_rows_never_allow_raw_control_characters(engine):
    """xgrammar's length-bounded strings allow raw control characters (invalid JSON); JSON rows mask them."""
    import torch

    from hf_paged.structured.matchers import StructuredMatchers

    tok = engine.tokenizer
    params = engine.prepare_structured(SamplingParams(structured_outputs={"json": {"type": "string", "maxLength": 4}}))
    grammar = params.structured_outputs
    assert grammar.token_mask is not None
    quote = tok.convert_tokens_to_ids('"')
    control = [t for t in range(len(tok)) if any(ord(ch) < 0x20 for ch in tok.decode([t]))
               and t not in engine.eos_token_ids]
    assert control
    for mask in (None, grammar.token_mask):
        matchers = StructuredMatchers()
        matchers.add(1, grammar.compiled, engine.eos_token_ids, [quote], kind="json", token_mask=mask)
        allowed = matchers.mask(torch.zeros(1, engine.vocab_size), [1])[0].isfinite()
        assert allowed.sum() > 100  # inside the string: most of the vocabulary
        if mask is None:
            assert allowed[control].any()  # xgrammar alone would let a raw control character into the string
        else:
            assert not allowed[control].any()
