"""The OpenAI API's request fields, checked without any web framework (responses: :mod:`hf_paged.serving.responses`).

Every bad field raises :class:`APIError` (HTTP 400, OpenAI's error JSON naming the field) before anything
reaches the engine. Extensions accepted as vLLM accepts them: ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``priority``; structured output and tool calls
(``response_format``, ``guided_*``, ``structured_outputs``, ``tools``) in :mod:`hf_paged.serving.structured`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from hf_paged.sampling_params import MAX_SEED, SamplingParams
from hf_paged.serving.api_error import APIError
from hf_paged.serving.request_fields import check_unhonoured
from hf_paged.serving.structured import ToolMode, parse_structured, template_takes_tools

MAX_LOGPROBS = 20
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a request body; OpenAI's requests need a handful


@dataclass
class ServedModel:
    """What the request parser needs to know about the model being served."""

    name: str
    tokenizer: Any
    max_model_len: int
    max_num_seqs: int
    aliases: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    # most prompts in one /v1/completions call; build_app caps it at the engine's waiting queue (a larger
    # list could never be queued), which is also its default
    max_prompts: int | None = None
    # LoRA adapters served beside the base model (``--lora-modules``, /v1/load_lora_adapter): name -> LoRARequest;
    # a request's ``model`` field picks one
    lora_modules: dict = field(default_factory=dict)

    def accepts(self, name: str) -> bool:
        return name == self.name or name in self.aliases


@dataclass
class ParsedRequest:
    """A checked request: token-id prompts and one SamplingParams for all of them."""

    kind: str  # "chat" or "completion"
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per token when log-probabilities were asked for
    priority: int = 0
    structured_param: str | None = None  # the field that constrains the output (named by its errors)
    tools: ToolMode | None = None  # chat: the output is returned as tool_calls


# -- field checks --------------------------------------------------------------------------------------
def _get(body: dict, name: str, default=None):
    value = body.get(name, default)
    return default if value is None else value


def _int(body: dict, name: str, default: int | None, low: int | None = None, high: int | None = None) -> int | None:
    value = _get(body, name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise APIError(f"{name} must be an integer, got {value!r}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        bound = f">= {low}" if high is None else (f"<= {high}" if low is None else f"between {low} and {high}")
        raise APIError(f"{name} must be {bound}, got {value}", param=name)
    return value


def _number(body: dict, name: str, default: float, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> float:
    value = _get(body, name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise APIError(f"{name} must be a finite number, got {value!r}", param=name)
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        left = "(" if low_open else "["
        raise APIError(f"{name} must be in {left}{low}, {high}], got {value}", param=name)
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = _get(body, name, default)
    if not isinstance(value, bool):
        raise APIError(f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _unsupported(body: dict, name: str, allowed=(None,), why: str = "") -> None:
    if name in body and not any(type(body[name]) is type(a) and body[name] == a for a in allowed):  # 0 is not False
        raise APIError(f"{name} is not supported by this server{why}", param=name, code="unsupported_parameter")


def _stop(body: dict) -> list[str] | None:
    value = body.get("stop")
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise APIError(f"stop must be a non-empty string or a list of non-empty strings, got {value!r}", param="stop")
    return value or None


def _stop_token_ids(body: dict) -> list[int] | None:
    value = body.get("stop_token_ids")
    if value is None:
        return None
    if not isinstance(value, list) or any(not _is_token(t) or t < 0 for t in value):
        raise APIError(f"stop_token_ids must be a list of token ids, got {value!r}", param="stop_token_ids")
    return [int(t) for t in value]


def _is_token(value) -> bool:
    """An integer, or a float with an integral value (JSON, and its schemas, do not tell 5 from 5.0)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _common(body: dict, served: ServedModel) -> tuple[str, dict, bool, bool, int]:
    """Fields shared by both endpoints: the model, sampling settings, streaming options, priority."""
    model = body.get("model")
    if model is None:
        model = served.name
    if not isinstance(model, str):
        raise APIError(f"model must be a string, got {model!r}", param="model")
    if not served.accepts(model) and model not in served.lora_modules:
        adapters = f" and the LoRA adapters {sorted(served.lora_modules)}" if served.lora_modules else ""
        raise APIError(f"The model {model!r} does not exist; this server serves {served.name!r}{adapters}", 404,
                       param="model", code="model_not_found")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise APIError(f"{name} is not supported by this engine (only 0); use repetition_penalty "
                           "(> 0, 1 disables)", param=name, code="unsupported_parameter")
    logit_bias = body.get("logit_bias")
    if logit_bias is not None and logit_bias != {}:
        raise APIError("logit_bias is not supported by this server", param="logit_bias", code="unsupported_parameter")
    n = _int(body, "n", 1, 1)
    if n > served.max_num_seqs:
        raise APIError(f"n must be <= {served.max_num_seqs} (the server's max_num_seqs), got {n}", param="n")
    top_k = _int(body, "top_k", 0, -1)
    kw = dict(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=0 if top_k == -1 else top_k,  # vLLM's "disabled"
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, None, low_open=True),
        seed=_int(body, "seed", None, 0, MAX_SEED - n + 1),
        n=n,
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=_bool(body, "ignore_eos", False),
        min_tokens=_int(body, "min_tokens", 0, 0),
    )
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        if not isinstance(options, dict):
            raise APIError(f"stream_options must be an object, got {options!r}", param="stream_options")
        include_usage = _bool(options, "include_usage", False)
    priority = _int(body, "priority", 0)
    return model, kw, stream, include_usage, priority


def _max_tokens(name: str, value: int | None, prompts: list[list[int]], served: ServedModel, default: int | None,
                prompt_field: str) -> int:
    longest = max(len(p) for p in prompts)
    room = served.max_model_len - longest
    if room < 1:
        raise APIError(f"the prompt has {longest} tokens, which leaves no room to generate within the model's "
                       f"context length of {served.max_model_len} tokens", param=prompt_field, code="context_length_exceeded")
    if value is None:
        return min(room, default) if default is not None else room
    if value > room:
        raise APIError(f"{name}={value} is too large: the prompt has {longest} tokens and the model's context length "
                       f"is {served.max_model_len}, so at most {room} new tokens fit", param=name,
                       code="context_length_exceeded")
    return value


def _params(kw: dict, max_tokens: int, logprobs: int | None, param_of_error: str) -> SamplingParams:
    if kw["min_tokens"] > max_tokens:
        raise APIError(f"min_tokens must be <= max_tokens ({max_tokens}), got {kw['min_tokens']}", param="min_tokens")
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kw)
    except (ValueError, TypeError) as e:  # a combination the engine refuses: name the field it names
        message = str(e)
        param = next((k for k in (*kw, "max_tokens", "logprobs") if message.startswith(k)), param_of_error)
        raise APIError(message, param=param) from e


# -- /v1/completions ----------------------------------------------------------------------------------------
def parse_completion(body: Any, served: ServedModel) -> ParsedRequest:
    """Check a ``/v1/completions`` body; prompts may be a string, a list of strings, token ids or lists of them."""
    body = _object(body)
    model, kw, stream, include_usage, priority = _common(body, served)
    check_unhonoured(body, "completion")
    _unsupported(body, "echo", (None, False))
    _unsupported(body, "suffix", (None, ""))
    best_of = _int(body, "best_of", None, 1)
    if best_of is not None and best_of != kw["n"]:
        raise APIError("best_of other than n is not supported by this server", param="best_of",
                       code="unsupported_parameter")
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    kw["structured_outputs"], structured_param, _ = parse_structured(body, "completion", served.tokenizer)
    prompts = _completion_prompts(body.get("prompt"), served)
    max_tokens = _max_tokens("max_tokens", _int(body, "max_tokens", None, 1), prompts, served, default=16,
                             prompt_field="prompt")
    params = _params(kw, max_tokens, logprobs, "prompt")
    return ParsedRequest("completion", model, prompts, params, stream, include_usage, logprobs, priority,
                         structured_param)


def _completion_prompts(prompt: Any, served: ServedModel) -> list[list[int]]:
    if prompt is None:
        raise APIError("prompt is required", param="prompt")
    if isinstance(prompt, str):
        items: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise APIError(f"prompt must be a non-empty string, a list of strings, a list of token ids or a list of "
                       f"such lists, got {prompt!r}", param="prompt")
    if served.max_prompts is not None and len(items) > served.max_prompts:
        raise APIError(f"prompt is a list of {len(items)} prompts, more than the limit of {served.max_prompts} "
                       f"prompts in one request on this server; send them in several requests", param="prompt",
                       code="too_many_prompts")
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise APIError("prompt must not be empty", param="prompt")
            if served.tokenizer is None:
                raise APIError("this server has no tokenizer: give the prompt as token ids", param="prompt")
            out.append(list(served.tokenizer(item)["input_ids"]))
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            out.append([int(t) for t in item])
        else:
            raise APIError(f"prompt entries must be non-empty strings or lists of token ids, got {item!r}",
                           param="prompt")
    return out


# -- /v1/chat/completions -----------------------------------------------------------------------------------
ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: Any, served: ServedModel) -> ParsedRequest:
    """Check a ``/v1/chat/completions`` body and apply the model's chat template."""
    body = _object(body)
    model, kw, stream, include_usage, priority = _common(body, served)
    check_unhonoured(body, "chat")
    _unsupported(body, "audio", (None, []))
    _unsupported(body, "modalities", (None, ["text"]))
    kw["structured_outputs"], structured_param, tools = parse_structured(body, "chat", served.tokenizer)
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    messages = chat_messages(body.get("messages"))
    prompt = apply_chat_template(served.tokenizer, messages, tools.template_tools if tools else None)
    value = _int(body, "max_completion_tokens", None, 1)
    name = "max_completion_tokens"
    legacy = _int(body, "max_tokens", None, 1)
    if value is None:
        value, name = legacy, "max_tokens"
    elif legacy is not None:  # overridden, but a value that could never fit is still an error
        _max_tokens("max_tokens", legacy, [prompt], served, default=None, prompt_field="messages")
    max_tokens = _max_tokens(name, value, [prompt], served, default=None, prompt_field="messages")
    params = _params(kw, max_tokens, logprobs, "messages")
    return ParsedRequest("chat", model, [prompt], params, stream, include_usage, logprobs, priority,
                         structured_param, tools)


def chat_messages(messages: Any) -> list[dict]:
    """Check chat messages; content parts of type "text" are joined into one string."""
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(f"{where} must be an object with 'role' and 'content', got {message!r}", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise APIError(f"{where}.role must be one of {list(ROLES)}, got {role!r}", param=f"{where}.role")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(f"{where}.content: only text parts are supported, got {part!r}",
                                   param=f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise APIError(f"{where}.content must be a string or a list of text parts, got {content!r}",
                           param=f"{where}.content")
        check_text(f"{where}.content", content)  # hf-paged batch reads messages without check_body
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def apply_chat_template(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt's token ids; ``tools`` are shown to the model where its template takes them."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template: use /v1/completions", param="messages")
    extra = {"tools": tools} if tools and template_takes_tools(tokenizer) else {}
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                            **extra)
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages (e.g. the order of roles)
        raise APIError(f"the chat template rejected these messages: {e}", param="messages") from e
    return list(ids)


def check_body(body: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse a parsed JSON body whose arrays and objects nest deeper than ``limit``, or with a string (or key)
    that is not valid Unicode, naming where (without recursing)."""
    check_text("body", body)
    stack = [(body, 1, "")] if isinstance(body, (dict, list)) else []
    while stack:
        value, depth, path = stack.pop()
        if depth > limit:
            raise APIError(f"the request body is nested too deeply: more than {limit} levels of arrays and objects",
                           param="body")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:  # a path is built only where it may be needed: a token id list stays cheap
            if isinstance(key, str) and not key.isascii():
                check_text(f"a key of {path or 'the request body'}", key, path or "body")
            if isinstance(child, str):
                if not child.isascii():
                    check_text(_path(path, key), child)
            elif isinstance(child, (dict, list)):
                stack.append((child, depth + 1, _path(path, key)))


def _path(path: str, key: str | int) -> str:
    """``messages[0].content``: where a value sits in the body."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def check_text(where: str, text: object, param: str | None = None) -> None:
    """Refuse a string with a lone surrogate (JSON allows ``"\\ud800"``; no text encoding does, so the tokenizer
    and the chat template fail on it) with a 400 naming ``where``."""
    if not isinstance(text, str) or text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"{where} is not valid Unicode: it holds a lone surrogate ({text[e.start]!r}) at character "
                       f"{e.start}; a \\uD800-\\uDFFF escape must be half of a high-low surrogate pair",
                       param=param or where, code="invalid_unicode") from None


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}", param="body")
    return body
