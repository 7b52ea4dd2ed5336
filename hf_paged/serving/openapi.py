"""The server's OpenAPI schema: the real request bodies and every answer each route gives.

The routes read their JSON bodies themselves (``serving/protocol.py`` checks every field and answers OpenAI's
error shape), so FastAPI alone would publish empty request bodies and one untyped 200. :func:`install_openapi`
fills ``/openapi.json`` in from the same rules: the fields each endpoint reads with their types and bounds
(the served model's names, ``n`` up to ``max_num_seqs``, ``max_tokens`` below ``max_model_len``, prompt lists
up to ``max_prompts``), the 200 bodies (JSON, or server-sent events when ``stream`` is true) and the error
statuses with OpenAI's error object. A client generator or a schema fuzzer (the test suite runs schemathesis
against it) sees the API as it is. Unknown request fields are allowed: the server ignores them, as OpenAI does.
"""

from __future__ import annotations

from typing import Any

from hf_paged.sampling_params import FLOAT32_MAX, FLOAT32_TINY, MAX_SEED
from hf_paged.serving.protocol import MAX_LOGPROBS, ROLES, ServedModel

JSON = "application/json"
SSE = "text/event-stream"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _opt(types: str | list[str], **rules: Any) -> dict:
    """A field that may also be ``null`` (the server reads null as "not given", as OpenAI does)."""
    types = [types] if isinstance(types, str) else list(types)
    return {"type": [*types, "null"], **rules}


def _sampling_fields(served: ServedModel) -> dict[str, dict]:
    """Fields both generation endpoints read (``protocol._common``)."""
    max_tokens = max(served.max_model_len - 1, 1)
    return {
        "model": _opt("string", enum=[served.name, *served.aliases, None],
                      description="The served model's id (or an alias); the served model when left out."),
        "max_tokens": _opt("integer", minimum=1, maximum=max_tokens,
                           description="New tokens at most; prompt + max_tokens must fit max_model_len."),
        "temperature": _opt("number", minimum=0, maximum=2),
        "top_p": _opt("number", exclusiveMinimum=0, maximum=1),
        "top_k": _opt("integer", minimum=-1, description="0 or -1: off (vLLM's extension)."),
        "min_p": _opt("number", minimum=0, maximum=1),
        "repetition_penalty": _opt("number", minimum=FLOAT32_TINY, maximum=FLOAT32_MAX,
                                   description="1 disables it; must stay > 0 in float32."),
        "presence_penalty": {"enum": [0, None], "description": "Only 0 is supported (use repetition_penalty)."},
        "frequency_penalty": {"enum": [0, None], "description": "Only 0 is supported (use repetition_penalty)."},
        "logit_bias": _opt("object", maxProperties=0, description="Not supported: only empty or null."),
        "n": _opt("integer", minimum=1, maximum=served.max_num_seqs),
        "seed": _opt("integer", minimum=0, maximum=MAX_SEED),
        "stop": {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1}},
                           {"type": "null"}]},
        "stop_token_ids": _opt("array", items={"type": "integer", "minimum": 0}),
        "ignore_eos": _opt("boolean"),
        "min_tokens": _opt("integer", minimum=0, maximum=max_tokens),
        "stream": _opt("boolean"),
        "stream_options": _opt("object", properties={"include_usage": _opt("boolean")},
                               description="Only with stream: true."),
        "priority": _opt("integer", description='Lower runs first under scheduling_policy="priority".'),
    }


def _structured_fields() -> dict[str, dict]:
    """Output constraints both generation endpoints read (``serving/structured.py``; at most one a request)."""
    schema = {"type": ["object", "boolean", "string"], "description": "A JSON schema (or its JSON text)."}
    return {
        "response_format": {"anyOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "required": ["schema"], "properties": {
                    "name": {"type": "string"}, "description": {"type": "string"}, "schema": schema,
                    "strict": {"type": ["boolean", "null"]}}}}},
            {"type": "null"},
        ], "description": "Plain text, any JSON object, or JSON valid under a schema."},
        "guided_json": {"anyOf": [schema, {"type": "null"}], "description": "vLLM's: JSON valid under this schema."},
        "guided_regex": _opt("string", description="vLLM's: text matching this regular expression."),
        "guided_choice": _opt("array", minItems=1, items={"type": "string"}, description="vLLM's: one of these."),
        "guided_grammar": _opt("string", description="vLLM's: text of this EBNF grammar."),
        "guided_decoding_backend": {"enum": ["xgrammar", "auto", None]},
        "structured_outputs": _opt("object", description="vLLM's: one of json, json_object, regex, choice, grammar."),
    }


def _tool_fields() -> dict[str, dict]:
    """Chat's tools (``serving/structured.py``)."""
    function = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
        "parameters": {"type": "object", "description": "The arguments' JSON schema."}}}
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}
    return {
        "tools": _opt("array", items={"type": "object", "required": ["type", "function"],
                                      "properties": {"type": {"const": "function"}, "function": function}}),
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required", None]}, named],
                        "description": "'auto' needs a chat template that takes tools with <tool_call> tags."},
        "parallel_tool_calls": _opt("boolean"),
    }


def _needs(field: str, kind: str, flag: str) -> dict:
    """``field`` given (as a ``kind``, not null) needs the boolean ``flag`` set to true."""
    return {"if": {"required": [field], "properties": {field: {"type": kind}}},
            "then": {"required": [flag], "properties": {flag: {"const": True}}}}


def _stream_options_need_stream() -> dict:
    return _needs("stream_options", "object", "stream")


def _token_ids() -> dict:
    return {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}


def completion_request(served: ServedModel) -> dict:
    """The body of ``POST /v1/completions``."""
    many = {} if served.max_prompts is None else {"maxItems": served.max_prompts}
    prompt = {"anyOf": [
        {"type": "string", "minLength": 1},
        _token_ids(),
        {"type": "array", "minItems": 1, **many, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, **many, "items": _token_ids()},
    ], "description": "A string, token ids, or a list of either (one completion each)."}
    return {
        "type": "object", "required": ["prompt"],
        "properties": {
            "prompt": prompt,
            **_sampling_fields(served),
            "logprobs": _opt("integer", minimum=0, maximum=MAX_LOGPROBS),
            "echo": {"enum": [False, None], "description": "Not supported."},
            "suffix": {"enum": ["", None], "description": "Not supported."},
            "best_of": _opt("integer", minimum=1, maximum=served.max_num_seqs, description="Only equal to n."),
            **_structured_fields(),
        },
        "allOf": [_stream_options_need_stream()],
    }


def chat_request(served: ServedModel) -> dict:
    """The body of ``POST /v1/chat/completions``."""
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}],
               "description": "Text, or text parts (joined)."}
    message = {"anyOf": [  # content is optional (and may be null) for the assistant only
        {"type": "object", "required": ["role", "content"],
         "properties": {"role": {"enum": [r for r in ROLES if r != "assistant"]}, "content": content}},
        {"type": "object", "required": ["role"],
         "properties": {"role": {"const": "assistant"}, "content": {"anyOf": [content, {"type": "null"}]}}},
    ]}
    max_tokens = max(served.max_model_len - 1, 1)
    return {
        "type": "object", "required": ["messages"],
        "properties": {
            "messages": {"type": "array", "minItems": 1, "items": message},
            **_sampling_fields(served),
            "max_completion_tokens": _opt("integer", minimum=1, maximum=max_tokens,
                                          description="As max_tokens, which it overrides."),
            "logprobs": _opt("boolean"),
            "top_logprobs": _opt("integer", minimum=0, maximum=MAX_LOGPROBS, description="Needs logprobs: true."),
            **_structured_fields(),
            **_tool_fields(),
        },
        "allOf": [_stream_options_need_stream(), _needs("top_logprobs", "integer", "logprobs")],
    }


def _usage() -> dict:
    count = {"type": "integer", "minimum": 0}
    return {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
            "properties": {"prompt_tokens": count, "completion_tokens": count, "total_tokens": count,
                           "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": count}}}}


def _response(kind: str, choice: dict, chunk: bool = False) -> dict:
    """A whole answer, or (``chunk``) one streamed event's (whose ``usage`` is null but in the last one)."""
    return {
        "type": "object", "required": ["id", "object", "created", "model", "choices", *([] if chunk else ["usage"])],
        "properties": {
            "id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
            "model": {"type": "string"}, "system_fingerprint": {"type": ["string", "null"]},
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "finish_reason"],
                "properties": {"index": {"type": "integer", "minimum": 0},
                               "finish_reason": {"type": ["string", "null"]}, **choice},
            }},
            "usage": {"anyOf": [_ref("Usage"), {"type": "null"}]} if chunk else _ref("Usage"),
        },
    }


def _event(chunk: str) -> dict:
    """One server-sent event of a streamed answer: a JSON chunk, an error object, or the closing ``[DONE]``."""
    payload = {"type": "string", "contentMediaType": JSON,
               "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, payload]}}}


def _schemas() -> dict[str, dict]:
    """Response bodies, OpenAI's shapes."""
    number = {"type": "number"}
    token = {"type": "object", "required": ["token", "logprob"],
             "properties": {"token": {"type": "string"}, "logprob": number,
                            "bytes": {"type": "array", "items": {"type": "integer"}}}}
    chat_logprobs = {"type": ["object", "null"], "properties": {"content": {"type": "array", "items": {
        **token, "properties": {**token["properties"], "top_logprobs": {"type": "array", "items": token}}}}}}
    completion_logprobs = {"type": ["object", "null"], "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": number},
        "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": number}},
        "text_offset": {"type": "array", "items": {"type": "integer"}},
    }}
    call = {"type": "object", "required": ["id", "type", "function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"}, "index": {"type": "integer", "minimum": 0},
        "function": {"type": "object", "required": ["name", "arguments"],
                     "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
    calls = {"type": "array", "items": call}
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                              "tool_calls": calls}}
    delta = {"type": "object", "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                                              "tool_calls": calls}}
    text = {"text": {"type": "string"}, "logprobs": completion_logprobs}
    return {
        "Usage": _usage(),
        "Completion": _response("text_completion", text),
        "CompletionChunk": _response("text_completion", text, chunk=True),
        "ChatCompletion": _response("chat.completion", {"message": message, "logprobs": chat_logprobs}),
        "ChatCompletionChunk": _response("chat.completion.chunk", {"delta": delta, "logprobs": chat_logprobs},
                                         chunk=True),
        "Error": {
            "type": "object", "required": ["error"],
            "properties": {"error": {
                "type": "object", "required": ["message", "type", "param", "code"],
                "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                               "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
            }},
        },
        "ModelList": {
            "type": "object", "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
                "type": "object", "required": ["id", "object", "created", "owned_by"],
                "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                               "owned_by": {"type": "string"}, "root": {"type": "string"},
                               "parent": {"type": "string", "description": "A LoRA adapter's base model."},
                               "max_model_len": {"type": "integer"}},
            }}},
        },
        "Health": {"type": "object", "required": ["status"], "properties": {
            "status": {"type": "string"}, "error": {"type": "string", "description": "Why the engine failed."}}},
    }


ERRORS = {
    400: "A bad field (named in error.param; code invalid_unicode: text with a lone surrogate), a body that is not "
         "a JSON object or is nested too deeply, or an output constraint whose grammar does not compile within the "
         "server's budget (code grammar_too_complex).",
    401: "A wrong or missing API key (only when the server has one).",
    404: "An unknown model (code model_not_found).",
    413: "A body larger than the server's limit.",
    500: "The engine failed the request.",
    503: "No room in the waiting queue (code queue_full), the engine is shut down (engine_closed) or failed for good "
         "(engine_failed: the server exits, its supervisor restarts it); retry later.",
}


def _error(status: int) -> dict:
    out: dict = {"description": ERRORS[status], "content": {JSON: {"schema": _ref("Error")}}}
    if status == 503:
        out["headers"] = {"Retry-After": {"description": "Seconds to wait.", "schema": {"type": "string"}}}
    return out


def _generation(summary: str, request: dict, answer: str, chunk: str, api_key: bool) -> dict:
    statuses = [400, *([401] if api_key else []), 404, 413, 500, 503]
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": request}}},
        "responses": {
            "200": {"description": "The answer; with stream: true, server-sent events ending in 'data: [DONE]'.",
                    "content": {JSON: {"schema": _ref(answer)}, SSE: {"schema": _event(chunk)}}},
            **{str(s): _error(s) for s in statuses},
        },
        **({"security": [{"bearer": []}]} if api_key else {}),
    }


def operations(served: ServedModel, api_key: bool = False) -> dict[tuple[str, str], dict]:
    """``{(path, method): OpenAPI operation}`` for every route of the server."""
    models = {"summary": "The served model",
              "responses": {"200": {"description": "The served model.",
                                    "content": {JSON: {"schema": _ref("ModelList")}}},
                            **({"401": _error(401)} if api_key else {})},
              **({"security": [{"bearer": []}]} if api_key else {})}
    health = {"summary": "Liveness of the engine loop", "responses": {
        "200": {"description": "The engine loop runs.", "content": {JSON: {"schema": _ref("Health")}}},
        "503": {"description": "The engine loop is stopped, or the engine failed for good (error says why).",
                "content": {JSON: {"schema": _ref("Health")}}}}}
    metrics = {"summary": "Prometheus metrics", "responses": {
        "200": {"description": "The Prometheus text format.",
                "content": {"text/plain": {"schema": {"type": "string"}}}},
        "404": _error(404) | {"description": "Metrics are disabled on this server."}}}
    return {
        **_lora_operations(api_key),
        ("/v1/completions", "post"): _generation("Text completions", completion_request(served), "Completion",
                                                 "CompletionChunk", api_key),
        ("/v1/chat/completions", "post"): _generation("Chat completions", chat_request(served), "ChatCompletion",
                                                      "ChatCompletionChunk", api_key),
        ("/v1/models", "get"): models,
        ("/health", "get"): health,
        ("/metrics", "get"): metrics,
    }


def _lora_operations(api_key: bool) -> dict[tuple[str, str], dict]:
    """The LoRA routes (with ``--enable-lora``; a 400 otherwise)."""
    def body(required: list[str]) -> dict:
        return {"required": True, "content": {JSON: {"schema": {
            "type": "object", "required": required,
            "properties": {"lora_name": {"type": "string", "minLength": 1},
                           "lora_path": {"type": "string", "minLength": 1,
                                         "description": "A PEFT adapter folder on the server."}}}}}}

    def answers(done: str, missing: str) -> dict:
        return {"200": {"description": done, "content": {"text/plain": {"schema": {"type": "string"}}}},
                "400": _error(400) | {"description": "A bad field, a folder that is no fitting LoRA adapter (the "
                                                     "message names the file and the mismatch), or no --enable-lora."},
                "404": _error(404) | {"description": missing},
                **({"401": _error(401)} if api_key else {})}

    security = {"security": [{"bearer": []}]} if api_key else {}
    return {
        ("/v1/load_lora_adapter", "post"): {"summary": "Load a LoRA adapter", "requestBody": body(
            ["lora_name", "lora_path"]), "responses": answers("Loaded.", "Not used by this route."), **security},
        ("/v1/unload_lora_adapter", "post"): {"summary": "Unload a LoRA adapter", "requestBody": body(["lora_name"]),
                                              "responses": answers("Unloaded.", "No adapter of that name."), **security},
    }


def install_openapi(app, served: ServedModel, api_key: bool = False) -> None:
    """Make ``app.openapi()`` (``/openapi.json``) describe the routes' real bodies and answers."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            for (path, method), operation in operations(served, api_key).items():
                if method in schema.get("paths", {}).get(path, {}):
                    schema["paths"][path][method] = {**schema["paths"][path][method], **operation}
            components = schema.setdefault("components", {})
            components.setdefault("schemas", {}).update(_schemas())
            if api_key:
                components.setdefault("securitySchemes", {})["bearer"] = {"type": "http", "scheme": "bearer"}
        return app.openapi_schema

    app.openapi = openapi
