"""Structured output and tool calls through the OpenAI server, with the official ``openai`` client.

A tiny random Llama with the default tokenizer: its words are random, so only the grammar makes the answers
valid JSON, regex matches, choices and tool calls.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from tests.serving_helpers import TINY_NAME, default_tokenizer, serve, tiny_chat_model, used_blocks  # noqa: E402

CHAT = [{"role": "user", "content": "Give me a record"}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "size": {"enum": ["S", "M", "L"]}},
    "required": ["name", "size"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                         "unit": {"enum": ["C", "F"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    tok = default_tokenizer()
    with serve(tiny_chat_model(tok), tok, TINY_NAME, max_num_seqs=8) as (url, loop):
        yield url, loop


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, **kw):
    kw = {"max_tokens": 60, "temperature": 1.0, "seed": 1, **kw}
    return client.chat.completions.create(model=TINY_NAME, messages=CHAT, **kw)


def test_response_format_json_schema_and_json_object(client):
    r = chat(client, n=3, response_format={"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA,
                                                                                  "strict": True}})
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    r = chat(client, max_tokens=8, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    # streamed: the deltas add up to a valid record
    chunks = list(chat(client, stream=True, response_format={"type": "json_schema",
                                                             "json_schema": {"name": "rec", "schema": SCHEMA}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_vllm_guided_fields_on_chat_and_completions(client):
    r = chat(client, extra_body={"guided_regex": r"[A-Z][a-z]{2,5} [0-9]{2}"})
    assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", r.choices[0].message.content)
    r = client.completions.create(model=TINY_NAME, prompt="Pick:", max_tokens=10, n=4, seed=2,
                                  extra_body={"guided_choice": ["alpha", "beta"]})
    assert {c.text for c in r.choices} <= {"alpha", "beta"}
    r = client.completions.create(model=TINY_NAME, prompt="JSON:", max_tokens=60, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = chat(client, extra_body={"guided_grammar": 'root ::= "x" [0-9] | "y"'})
    assert re.fullmatch(r"x[0-9]|y", r.choices[0].message.content)
    r = chat(client, extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert r.choices[0].message.content in ("up", "down")


def test_tool_choice_named_and_required(client):
    r = chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    r = chat(client, n=4, max_tokens=300, tools=[WEATHER, TIME], tool_choice="required")
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

    r = chat(client, n=3, max_tokens=300, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert all(c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1 for c in r.choices)

    # "none": the tools are ignored and the answer is text
    r = chat(client, max_tokens=5, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_tool_calls_stream_in_the_last_chunk(client):
    chunks = list(chat(client, stream=True, max_tokens=300, tools=[WEATHER], tool_choice="required"))
    assert chunks[0].choices[0].delta.role == "assistant"
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].index == 0 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_a_call_cut_by_max_tokens_is_length_and_text(client):
    r = chat(client, max_tokens=3, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None and c.message.content.startswith("{")


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"guided_regex": "(a"}, "guided_regex", "parenthesis"),
    ({"guided_regex": r"[^\s\S]"}, "guided_regex", "can match nothing"),
    ({"guided_regex": r"\d+\z"}, "guided_regex", r"escape \z"),
    ({"guided_grammar": 'root ::= x\nx ::= x "b"'}, "guided_grammar", "can match nothing"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "'uniqueItems' at #/uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"allOf": [{"type": "integer"}, {"minimum": 2}]}}}}}},
     "response_format", "'allOf' at #/properties/a/allOf"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"not": {"type": "null"}}}}}}], "tool_choice": "required"}, "tools[0].function.parameters",
     "'not' at #/properties/a/not"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {
        "b": {"type": "string", "format": "date", "maxLength": 3}}}}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tools[1].function.parameters", "'maxLength' at #/properties/b"),
    ({"guided_grammar": 'start ::= "a"'}, "guided_grammar", "root"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"structured_outputs": {"json_schema": SCHEMA}}, "structured_outputs", "unknown"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    ({"guided_json": SCHEMA, "min_tokens": 2}, "min_tokens", "min_tokens"),
    ({"tools": [WEATHER]}, "tools", "<tool_call> tags"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "<tool_call> tags"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bad"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "invalid JSON schema"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]", "function"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"functions": [WEATHER["function"]]}, "functions", "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
    ({"use_beam_search": True}, "use_beam_search", "not supported"),
    ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs", "not supported"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output", "not supported"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "not supported"),
]


def test_bad_constraints_are_400s_before_admission_and_others_are_unaffected(server):
    url, loop = server

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            good = asyncio.ensure_future(http.post("/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": 40, "temperature": 0, "guided_json": SCHEMA}))
            answers = [await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8, **body})
                       for body, _, _ in BAD]
            answers.append(await http.post("/v1/completions", json={"prompt": "x", "tools": [WEATHER]}))
            answers.append(await http.post("/v1/completions", json={"prompt": "x", "allowed_token_ids": [1, 2]}))
            ignored = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "user": "u",
                                                               "metadata": {"a": "b"}, "skip_special_tokens": True})
            assert ignored.status_code == 200, ignored.text  # fields that change nothing are accepted
            return await good, answers

    good, answers = asyncio.run(main())
    jsonschema.validate(json.loads(good.json()["choices"][0]["message"]["content"]), SCHEMA)
    expected = BAD + [(None, "tools", "chat"), (None, "allowed_token_ids", "not supported")]
    for r, (body, param, words) in zip(answers, expected):
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (body, err)
    assert used_blocks(loop) == 0 and loop.num_live_requests == 0


HERMES = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}</tools>\nAnswer a call as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hermes_server():
    """A tokenizer whose chat template takes tools and marks calls with <tool_call> tags (Hermes / Qwen)."""
    tok = default_tokenizer()
    tok.chat_template = HERMES
    with serve(tiny_chat_model(tok), tok, TINY_NAME, max_num_seqs=4) as (url, loop):
        yield url, loop, tok


def test_tool_choice_auto_with_a_template_that_takes_tools(hermes_server):
    """"auto": the tools reach the template; <tool_call> blocks in the answer become tool_calls, and an answer
    without them is content. The random model is steered into a call by a regex, as a model would choose one."""
    from hf_paged.serving.protocol import ServedModel, parse_chat

    url, loop, tok = hermes_server
    parsed = parse_chat({"messages": CHAT, "tools": [WEATHER]}, ServedModel(TINY_NAME, tok, 512, 4))
    assert "get_weather" in tok.decode(parsed.prompts[0]) and parsed.params.structured_outputs is None
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>'
    r = chat(client, tools=[WEATHER, TIME], extra_body={"guided_regex": "Sure\\. " + re.escape(call)})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure."
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Oslo", "unit": "C"}
    chunks = list(chat(client, stream=True, max_tokens=200, tools=[WEATHER], tool_choice="auto",
                       extra_body={"guided_regex": re.escape(call + call)}, parallel_tool_calls=False))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    r = chat(client, max_tokens=4, tools=[WEATHER], tool_choice="auto")  # no call: the answer is text
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    r = chat(client, tools=[WEATHER], extra_body={"guided_regex": re.escape(call.replace("get_weather", "nope"))})
    assert r.choices[0].message.tool_calls is None and "nope" in r.choices[0].message.content  # unknown: text


def test_every_refused_schema_keyword_is_a_400_naming_it(server):
    """Each schema the engine refuses (tests/test_structured_schema_support.py) is a 400 before admission, as
    response_format and as guided_json, naming the keyword and its JSON pointer."""
    from tests.test_structured_schema_support import REFUSED

    url, loop = server

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            answers = []
            for schema, _, _ in REFUSED:
                fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
                answers.append(await http.post("/v1/chat/completions", json={"messages": CHAT, "response_format": fmt}))
                answers.append(await http.post("/v1/completions", json={"prompt": "x", "guided_json": schema}))
            # tools whose calls are not constrained ("none": no grammar) are not checked
            tool = {"type": "function", "function": {"name": "f", "parameters": REFUSED[0][0]}}
            free = await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "tools": [tool],
                                                                 "tool_choice": "none"})
            assert free.status_code == 200, free.text
            return answers

    answers = asyncio.run(main())
    for i, r in enumerate(answers):
        _, keyword, path = REFUSED[i // 2]
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == ("response_format", "guided_json")[i % 2], err
        assert f"{keyword!r} at {path} is not enforced" in err["message"], err
    assert used_blocks(loop) == 0 and loop.num_live_requests == 0


def test_a_grammar_dead_end_is_a_400_naming_the_constraint(client, server):
    """A regex that allows "a" and then nothing fails at the step: a 400 naming guided_regex (never a 500 about
    non-finite logits), and in a stream an error event of the same kind."""
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, extra_body={"guided_regex": r"a[^\s\S]"})
    err = caught.value.body
    assert err["param"] == "guided_regex" and "structured_outputs.regex allows no token" in err["message"], err
    chunks = httpx.post(server[0] + "/v1/completions", timeout=120, json={
        "prompt": "x", "max_tokens": 8, "stream": True, "guided_regex": r"a[^\s\S]"}).text
    events = [json.loads(line[6:]) for line in chunks.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["type"] == "invalid_request_error", events[-1]
    assert "allows no token" in events[-1]["error"]["message"]
    assert used_blocks(server[1]) == 0
