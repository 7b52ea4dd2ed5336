"""Fuzz the OpenAI server from its own OpenAPI schema with schemathesis (issue #29): every route, requests the
schema allows (each must get a documented answer: no 500, the declared status, content type, headers and
body, streamed events included) and requests it forbids (each must be refused with a 4xx), against a live
server on loopback with a tiny random model and a 64-token context, so every generation is short.

Bounded: ``HF_PAGED_FUZZ_EXAMPLES`` (default 40) generated cases per route and mode (allowed / forbidden),
derandomized (the same cases on every run), each request with a 20 s timeout (a hang fails). A longer, random run::

    HF_PAGED_FUZZ_EXAMPLES=2000 HF_PAGED_FUZZ_RANDOM=1 pytest -q tests/test_server_fuzz.py
"""

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance, negative_data_rejection, response_headers_conformance, response_schema_conformance,
    status_code_conformance,
)

from tests.serving_helpers import TINY_NAME, default_tokenizer, serve, tiny_chat_model, used_blocks, wait_until

EXAMPLES = int(os.environ.get("HF_PAGED_FUZZ_EXAMPLES", "40"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]


@pytest.fixture(scope="module")
def server():
    # schemathesis reads at most a set number of a stream's events, then hangs up: the server aborts the rest,
    # which leaves the queue at the loop's next iteration. So the queue holds several calls' prompts (at most 8
    # a call), or the next call could be a 503 queue_full, rightly, while the last one's prompts still wait.
    tok = default_tokenizer()
    with serve(tiny_chat_model(tok), tok, TINY_NAME, num_blocks=64, max_num_seqs=4, max_model_len=64,
               max_waiting_requests=64, max_prompts=8) as (url, loop):
        loop.engine.warm_structured()  # as hf-paged serve does: fuzzed schemas never wait for the compile worker
        yield url, loop
        wait_until(lambda: loop.num_live_requests == 0, what="no live request after fuzzing")
        assert used_blocks(loop) == 0


@pytest.fixture(scope="module")
def api_schema(server):
    url, _ = server
    return schemathesis.openapi.from_url(url + "/openapi.json")


ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/health"),
          ("GET", "/metrics")]
# bodies the schema allows and bodies it forbids; the GET routes take no input, so only the former
MODES = {"POST": (GenerationMode.POSITIVE, GenerationMode.NEGATIVE), "GET": (GenerationMode.POSITIVE,)}
CASES = [(method, path, mode) for method, path in ROUTES for mode in MODES[method]]


# (schemathesis.pytest.from_fixture would do this, but its lazy loader breaks under pytest 9)
@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_fuzz_the_api_from_its_openapi_schema(api_schema, server, method, path, mode):
    url, loop = server
    operation = api_schema[path][method]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("HF_PAGED_FUZZ_RANDOM"),
              database=None, phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        response = case.call(base_url=url, timeout=20)
        case.validate_response(response, checks=CHECKS)

    fuzz()


def test_the_schema_describes_the_request_bodies(api_schema, server):
    """The published schema has the real fields (not FastAPI's empty body), with the served model's limits."""
    raw = api_schema.raw_schema
    completions = raw["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    chat = raw["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert completions["required"] == ["prompt"] and chat["required"] == ["messages"]
    for body in (completions, chat):
        fields = body["properties"]
        assert {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream"} <= set(fields)
        assert fields["n"]["maximum"] == 4 and fields["max_tokens"]["maximum"] == 63
        assert fields["model"]["enum"][0] == TINY_NAME
    assert "max_completion_tokens" in chat["properties"] and "logprobs" in completions["properties"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = raw["paths"][path]["post"]["responses"]
        assert {"200", "400", "404", "413", "500", "503"} <= set(responses)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(raw["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                                 "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    load = raw["paths"]["/v1/load_lora_adapter"]["post"]
    assert load["requestBody"]["content"]["application/json"]["schema"]["required"] == ["lora_name", "lora_path"]


# What the fuzzer found, pinned (each failed before its fix).
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "Hi", "echo": 0.0}, "echo"),  # 0.0 == False in Python: was accepted
    ("/v1/completions", {"prompt": "Hi", "logit_bias": 0}, "logit_bias"),  # a falsy non-object: was accepted
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2,
                              "max_tokens": 10**6}, "max_tokens"),  # overridden, so never checked
], ids=["echo-0.0", "logit_bias-0", "max_tokens-beside-max_completion_tokens"])
def test_fields_the_fuzzer_found_accepted_are_refused(server, path, body, param):
    url, _ = server
    r = httpx.post(url + path, json={"model": TINY_NAME, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_integral_float_token_ids_are_token_ids(server):
    """JSON (and its schemas) do not tell 150 from 150.0; the scalar fields already took 4.0."""
    url, _ = server
    answers = []
    for prompt, stop in (([150, 151], [7]), ([150.0, 151.0], [7.0])):
        r = httpx.post(url + "/v1/completions", json={"model": TINY_NAME, "prompt": prompt, "stop_token_ids": stop,
                                                      "max_tokens": 4, "temperature": 0}, timeout=30)
        assert r.status_code == 200, r.text
        answers.append((r.json()["choices"][0]["text"], r.json()["usage"]))
    assert answers[0] == answers[1]


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v1/completions", "POST"), ("DELETE", "/v1/chat/completions", "POST"), ("POST", "/health", "GET"),
    ("PUT", "/v1/models", "GET"),
])
def test_a_method_a_route_does_not_take_is_a_405_naming_the_allowed_ones(server, method, path, allow):
    url, _ = server
    r = httpx.request(method, url + path, timeout=30)
    assert r.status_code == 405
    assert r.headers["allow"] == allow  # RFC 9110; the error handler used to drop it
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_with_an_api_key_the_schema_declares_it_and_every_401():
    """``--api-key``: the schema names the bearer scheme on /v1/*, and the answers with and without the key
    conform (a 401 in OpenAI's error shape, then the fuzzed bodies with the key)."""
    tok = default_tokenizer()
    with serve(tiny_chat_model(tok), tok, TINY_NAME, api_key="sekrit", num_blocks=64, max_num_seqs=2,
               max_model_len=64) as (url, loop):
        api = schemathesis.openapi.from_url(url + "/openapi.json")
        assert api.raw_schema["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
        for method, path in ROUTES:
            declared = api.raw_schema["paths"][path][method.lower()]
            assert ("401" in declared["responses"]) == path.startswith("/v1/"), (method, path)
        body = {"model": TINY_NAME, "prompt": "Hi", "max_tokens": 2}
        for method, path, kw in (("GET", "/v1/models", {}), ("POST", "/v1/completions", {"body": body})):
            case = api[path][method].Case(**kw)
            response = case.call(base_url=url, timeout=20)
            assert response.status_code == 401
            case.validate_response(response, checks=CHECKS[:-1])
        key = {"Authorization": "Bearer sekrit"}

        @settings(max_examples=10, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=api["/v1/completions"]["POST"].as_strategy(generation_mode=GenerationMode.POSITIVE))
        def fuzz(case):
            response = case.call(base_url=url, timeout=20, headers=key)
            assert response.status_code != 401
            case.validate_response(response, checks=CHECKS)

        fuzz()
        wait_until(lambda: loop.num_live_requests == 0, what="no live request")
