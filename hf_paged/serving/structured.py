"""Structured output and tool calls in OpenAI requests: request fields -> a grammar, output -> ``tool_calls``.

Request fields (each a 400 naming it when malformed; at most one of them per request):

- ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}``, or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structured_outputs``
  (an object with one of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``);
- chat only: ``tools`` with ``tool_choice`` ``"required"`` (the output is a JSON array of ``{"name",
  "parameters"}`` calls to the given functions) or ``{"type": "function", "function": {"name"}}`` (the output
  is that function's arguments, valid under its ``parameters`` schema; ``parallel_tool_calls: false``: one
  call); ``"none"`` ignores the tools;
  ``"auto"`` (the default with tools) lets the model choose, where its chat template takes tools and marks calls
  with ``<tool_call>`` tags (Hermes / Qwen style): the answer's ``<tool_call>{"name", "arguments"}</tool_call>``
  blocks become ``tool_calls``; with any other template it is a 400.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from hf_paged.serving.api_error import APIError
from hf_paged.structured_params import CONSTRAINT_ERROR, KINDS, StructuredOutputsParams

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _error(message: str, param: str, code: str | None = None):
    return APIError(message, param=param, code=code)


@dataclass
class ToolMode:
    """How a chat request's output becomes ``tool_calls``: one named function's arguments, or a list of calls."""

    names: list[str]
    named: str | None = None  # tool_choice named this function: the whole output is its arguments
    template_tools: list[dict] = field(default_factory=list)  # the tools as the chat template takes them
    auto: bool = False  # the model chose: calls are its <tool_call> blocks, the rest is content
    single: bool = False  # parallel_tool_calls=false: at most one call

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message (``tool_calls``, no content) and the finish reason for this output text."""
        if finish_reason != "stop":  # cut short (length, abort): not a complete call
            return {"role": "assistant", "content": text}, finish_reason
        if self.auto:
            return self._auto_message(text, finish_reason)
        if self.named is not None:
            calls = [(self.named, text)]
        else:
            try:
                calls = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
            except (ValueError, KeyError, TypeError):
                return {"role": "assistant", "content": text}, finish_reason
        tool_calls = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                       "function": {"name": name, "arguments": arguments}} for name, arguments in calls]
        return {"role": "assistant", "content": None, "tool_calls": tool_calls}, "tool_calls"

    def _auto_message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        calls = []
        for block in _TOOL_CALL.findall(text):
            try:
                call = json.loads(block)
                name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
            except (ValueError, KeyError, TypeError, AttributeError):
                return {"role": "assistant", "content": text}, finish_reason  # not a well-formed call: text
            if name not in self.names:
                return {"role": "assistant", "content": text}, finish_reason
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {
                "name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        calls = calls[:1] if self.single else calls
        rest = _TOOL_CALL.sub("", text).strip()
        return {"role": "assistant", "content": rest or None, "tool_calls": calls}, "tool_calls"

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A streamed chunk's delta carrying the whole calls (sent once, when the output is complete)."""
        message, reason = self.message(text, finish_reason)
        message.pop("role")
        if message.get("tool_calls"):
            message["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            if message["content"] is None:
                message.pop("content")
        return message, reason


def parse_structured(body: dict, kind: str, tokenizer) -> tuple[StructuredOutputsParams | None, str | None,
                                                                ToolMode | None]:
    """The request's output constraint, the field that asked for it, and (chat) how to return tool calls."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = _response_format(body.get("response_format"))
    if fmt is not None:
        found.append(("response_format", fmt))
    for name, key in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _make(name, **{key: body[name]})))
    for name in ("guided_whitespace_pattern", "structural_tag"):
        if body.get(name) is not None:
            raise _error(f"{name} is not supported by this server", name, "unsupported_parameter")
    backend = body.get("guided_decoding_backend")
    if backend not in (None, "xgrammar", "auto"):
        raise _error(f"guided_decoding_backend must be 'xgrammar' (the only one here), got {backend!r}",
                     "guided_decoding_backend")
    value = body.get("structured_outputs")
    if value is not None:
        if not isinstance(value, dict):
            raise _error(f"structured_outputs must be an object with one of {list(KINDS)}, got {value!r}",
                         "structured_outputs")
        found.append(("structured_outputs", _make("structured_outputs", **value)))
    tools = None
    if kind == "chat":
        tools, tool_params = _tools(body, tokenizer)
        if tool_params is not None:
            found.append(("tools", tool_params))
    elif body.get("tools") or body.get("tool_choice") is not None:
        name = "tools" if body.get("tools") else "tool_choice"
        raise _error(f"{name} is only supported by /v1/chat/completions", name, "unsupported_parameter")
    if len(found) > 1:
        names = [name for name, _ in found]
        raise _error(f"only one output constraint per request, got {names}", names[1])
    if not found:
        return None, None, tools
    return found[0][1], found[0][0], tools


def _make(param: str, **kw: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams.from_value(kw)
    except (ValueError, TypeError) as e:
        raise _error(f"{param}: {str(e).replace('structured_outputs.', '')}", param) from e


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise _error(f"response_format must be an object with a type, got {fmt!r}", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise _error(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                     "response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise _error("response_format.json_schema must be an object with a name and a schema", "response_format.json_schema")
    schema = spec.get("schema")
    if schema is None:
        raise _error("response_format.json_schema.schema is required", "response_format.json_schema.schema")
    if spec.get("strict") not in (None, True, False):
        raise _error(f"response_format.json_schema.strict must be a boolean, got {spec['strict']!r}",
                     "response_format.json_schema.strict")
    return _make("response_format", json=schema)


def _tools(body: dict, tokenizer) -> tuple[ToolMode | None, StructuredOutputsParams | None]:
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise _error(f"{name} (deprecated) is not supported by this server: use tools and tool_choice", name,
                         "unsupported_parameter")
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise _error(f"tool_choice {choice!r} needs tools", "tool_choice")
        return None, None
    functions = _functions(tools)
    choice_param = "tool_choice" if choice is not None else "tools"  # tools alone mean tool_choice "auto"
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None, None
    template_tools = [{"type": "function", "function": f} for f in functions.values()]
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise _error(f"parallel_tool_calls must be a boolean, got {parallel!r}", "parallel_tool_calls")
    if choice == "auto":
        if not template_takes_tools(tokenizer) or "<tool_call>" not in tokenizer.chat_template:
            raise _error("tool_choice 'auto' needs a chat template that takes tools and marks calls with "
                         "<tool_call> tags (Hermes / Qwen style); this model's does not. Use tool_choice 'required' "
                         "or {'type': 'function', 'function': {'name': ...}}, which constrain the output to a call",
                         choice_param, "unsupported_parameter")
        return ToolMode(list(functions), None, template_tools, auto=True, single=parallel is False), None
    if choice == "required":
        _check_parameters(functions, list(functions))
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": f["parameters"]},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, f in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if parallel is False:
            schema["maxItems"] = 1
        return ToolMode(list(functions), None, template_tools), _make("tools", json=schema)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(named, str):
        raise _error(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                     f"{{'name': ...}}}}, got {choice!r}", "tool_choice")
    if named not in functions:
        raise _error(f"tool_choice names the function {named!r}, which is not in tools ({sorted(functions)})",
                     "tool_choice")
    _check_parameters(functions, [named])
    return ToolMode(list(functions), named, template_tools), _make("tools", json=functions[named]["parameters"])


def _check_parameters(functions: dict[str, dict], names: list[str]) -> None:
    """The parameters schemas of the functions a call is constrained to, each checked on its own (a 400 naming
    ``tools[i].function.parameters``, with JSON pointers into that schema)."""
    order = list(functions)
    for name in names:
        _make(f"tools[{order.index(name)}].function.parameters", json=functions[name]["parameters"])


def _functions(tools: Any) -> dict[str, dict]:
    if not isinstance(tools, list):
        raise _error(f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, got {tools!r}", "tools")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _error(f"{where} must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}, got {tool!r}",
                         where)
        function = dict(tool["function"])
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _error(f"{where}.function.name must be a non-empty string, got {name!r}", f"{where}.function.name")
        if name in out:
            raise _error(f"{where}: the function name {name!r} is given twice", f"{where}.function.name")
        params = function.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _error(f"{where}.function.parameters must be a JSON schema object, got {params!r}",
                         f"{where}.function.parameters")
        function["parameters"] = params
        out[name] = function
    if not out:
        raise _error("tools must not be empty", "tools")
    return out


def compile_grammar(engine, parsed, cancel=None, cached_only: bool = False):
    """Compile a parsed request's grammar (call it off the event loop: the server's compile thread; with
    ``cached_only``, on a request thread, it only sets a cached grammar); its errors are 400s naming the field
    that asked for the constraint. ``cancel``: a ``threading.Event`` that stops the compile when set."""
    prepare = getattr(getattr(engine, "engine", None), "prepare_structured", None)
    if parsed.params.structured_outputs is None or prepare is None:
        return parsed
    try:
        parsed.params = prepare(parsed.params, cancel=cancel, cached_only=cached_only)
    except (ValueError, TypeError) as e:
        message = str(e)
        param = next((f for f in ("min_tokens", "ignore_eos") if f in message), parsed.structured_param)
        code = "grammar_too_complex" if "structured_compile_timeout_s" in message else None
        raise APIError(message, 400, param=param, code=code) from e
    except ImportError as e:  # the structured extra is not installed
        raise APIError(str(e), 400, param=parsed.structured_param, code="unsupported_parameter") from e
    return parsed


def generation_error(parsed, message: str | None):
    """The APIError of a request that failed while generating: a 400 naming the constraint's field when its
    constraint turned out to admit no output, else a 500."""
    if message and message.startswith(CONSTRAINT_ERROR):
        return APIError(message, 400, param=parsed.structured_param)
    return APIError(message or "generation failed", 500, type="server_error")


def needs_compile(parsed) -> bool:
    """The request has a constraint whose grammar is not compiled yet."""
    wanted = parsed.params.structured_outputs
    return wanted is not None and wanted.compiled is None


def template_takes_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template
