"""The server's bad-input answers and its abort / rejection counts (issue #29, items 2 and 3), on a tiny random
model with the default tokenizer. The engine loop is held busy (``loop.call`` waiting on an event) where a
test needs requests to sit in the queue, so every case is deterministic."""

import asyncio
import gc
import logging
import threading

import httpx
import openai
import pytest

from tests.serving_helpers import TINY_NAME, default_tokenizer, scrape, serve, tiny_chat_model, used_blocks, wait_until

QUEUE = 2  # max_waiting_requests of the server under test
ABORTS = "hf_paged:request_success_total{finished_reason=abort}"
REJECTED = "hf_paged:requests_rejected_total{reason=queue_full}"


@pytest.fixture(scope="module")
def server():
    tok = default_tokenizer()
    with serve(tiny_chat_model(tok), tok, TINY_NAME, num_blocks=256, max_num_seqs=4,
               max_waiting_requests=QUEUE) as (url, loop):
        yield url, loop


class Held:
    """Keep the engine loop busy (requests submitted meanwhile wait in its inbox) until the block ends."""

    def __init__(self, loop) -> None:
        self.loop, self.release = loop, threading.Event()

    def __enter__(self) -> "Held":
        self.busy = self.loop.call(lambda e: self.release.wait(60))
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.busy.result(60)


def settle(loop) -> None:
    wait_until(lambda: loop.num_live_requests == 0, what="no live request")
    wait_until(lambda: used_blocks(loop) == 0, what="every block free")


def disconnect_while_queued(url, loop, body: dict, stream: bool) -> None:
    """Send ``body``, give up while the loop is held (the request sits in the queue), let the loop go on."""
    with Held(loop):
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=0.5)) as http:
                if stream:
                    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                        for _ in r.iter_lines():
                            pass
                else:
                    http.post("/v1/completions", json=body)
        wait_until(lambda: loop._aborts, what="the server's abort")
        asyncio.run(asyncio.sleep(0.3))  # every abort the server sends for it is in the loop's inbox


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_a_disconnect_is_one_abort_in_the_metrics(server, stream):
    url, loop = server
    settle(loop)
    before, aborted = scrape(url), loop.num_finished_by_reason["abort"]
    body = {"model": TINY_NAME, "prompt": "Tell me a long story", "max_tokens": 50, "ignore_eos": True}
    disconnect_while_queued(url, loop, body, stream)
    settle(loop)
    after = scrape(url)
    assert after[ABORTS] - before.get(ABORTS, 0) == 1
    assert loop.num_finished_by_reason["abort"] - aborted == 1
    e2e = "hf_paged:e2e_request_latency_seconds_count"
    assert after[e2e] - before[e2e] == 1  # the histograms saw it finish too


def test_a_503_is_a_rejection_not_an_abort(server):
    url, loop = server
    settle(loop)
    before, aborted = scrape(url), loop.num_finished_by_reason["abort"]

    async def main(held: Held):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            first = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))
            await asyncio.sleep(0.3)  # queued: one place of QUEUE left
            second = await http.post("/v1/completions", json={"prompt": ["b", "c"], "max_tokens": 2})
            held.release.set()
            return await first, second

    with Held(loop) as held:
        first, second = asyncio.run(main(held))
    assert first.status_code == 200
    assert second.status_code == 503 and second.headers["retry-after"] == "1"
    assert second.json()["error"]["code"] == "queue_full"
    settle(loop)
    after = scrape(url)
    assert after[ABORTS] - before.get(ABORTS, 0) == 0 and loop.num_finished_by_reason["abort"] == aborted
    assert after[REJECTED] - before.get(REJECTED, 0) == 2  # both prompts of the refused request
    assert after["hf_paged:requests_rejected_total{reason=engine_closed}"] == 0


def error_of(r: httpx.Response, status: int, param: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


def test_deeply_nested_json_is_a_400_and_the_connection_lives_on(server, caplog):
    url, loop = server
    caplog.set_level(logging.ERROR)
    with httpx.Client(base_url=url, timeout=60) as http:
        deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        err = error_of(http.post("/v1/completions", content=deep), 400, "body")
        assert "nested too deeply" in err["message"] and err["type"] == "invalid_request_error"
        # parsed by json, but deeper than any OpenAI request: refused before anything recurses over it
        body = {"model": TINY_NAME, "prompt": "Hi"}
        for _ in range(100):
            body = {"model": TINY_NAME, "prompt": "Hi", "metadata": body}
        assert "nested too deeply" in error_of(http.post("/v1/chat/completions", json=body), 400, "body")["message"]
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", '{"messages": [{"role": "system", "content": "Be brief."}, '
                             '{"role": "user", "content": "hi TEXT there"}]}', "messages[1].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "TEXT"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", '{"prompt": ["fine", "lone TEXT"]}', "prompt[1]"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["TEXT"]}', "stop[0]"),
], ids=["message", "content_part", "prompt", "stop"])
@pytest.mark.parametrize("lone", ["\\ud800", "\\udfff"], ids=["high", "low"])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param, lone, caplog):
    """JSON allows a lone surrogate escape ("\\ud800"); no text encoding does. It is refused with the field that
    holds it, before the chat template or the tokenizer (which failed on it with their own internals, or a 500)."""
    url, loop = server
    caplog.set_level(logging.ERROR)
    headers = {"content-type": "application/json"}
    body = body[:-1] + ', "max_tokens": 2}'
    with httpx.Client(base_url=url, timeout=60) as http:
        err = error_of(http.post(path, content=body.replace("TEXT", lone), headers=headers), 400, param)
        assert err["code"] == "invalid_unicode" and err["type"] == "invalid_request_error", err
        assert err["message"].startswith(f"{param} is not valid Unicode: it holds a lone surrogate ('{lone}')"), err
        ok = http.post(path, content=body.replace("TEXT", "\\ud83d\\ude00"), headers=headers)
        assert ok.status_code == 200, ok.text  # a pair is one character (an emoji): fine
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_more_prompts_than_the_queue_is_a_400_naming_the_cap(server):
    url, loop = server
    r = httpx.post(url + "/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2}, timeout=60)
    err = error_of(r, 400, "prompt")
    assert err["code"] == "too_many_prompts"
    assert "3 prompts" in err["message"] and f"limit of {QUEUE}" in err["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": [[5, 6]] * 3, "max_tokens": 2}, timeout=60)
    assert error_of(r, 400, "prompt")["code"] == "too_many_prompts"
    assert httpx.post(url + "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2},
                      timeout=60).status_code == 200  # as many as the queue holds is fine


def test_stop_token_ids_outside_the_vocabulary_are_named(server):
    url, loop = server
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        r = httpx.post(url + path, json={**body, "max_tokens": 2, "stop_token_ids": [3, 10**7]}, timeout=60)
        assert "vocabulary" in error_of(r, 400, "stop_token_ids")["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": [10**7], "max_tokens": 2}, timeout=60)
    assert "vocabulary" in error_of(r, 400, "prompt")["message"]  # a bad prompt is still the prompt


def test_an_unknown_model_is_a_404_model_not_found(server):
    url, loop = server
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        err = error_of(httpx.post(url + path, json={**body, "model": "gpt-4"}, timeout=60), 404, "model")
        assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
        assert "'gpt-4' does not exist" in err["message"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_a_body_too_large_is_a_413(server):
    url, loop = server
    big = b'{"prompt": "' + b"x" * (5 * 2**20) + b'"}'
    err = error_of(httpx.post(url + "/v1/completions", content=big, timeout=60), 413, "body")
    assert "limit" in err["message"] and err["code"] == "request_too_large"

    def chunks():  # no Content-Length: the server counts as it reads
        for i in range(0, len(big), 2**16):
            yield big[i:i + 2**16]

    assert "limit" in error_of(httpx.post(url + "/v1/completions", content=chunks(), timeout=60), 413,
                               "body")["message"]


def test_a_plain_disconnect_logs_nothing(server, caplog):
    url, loop = server
    settle(loop)
    caplog.set_level(logging.ERROR)
    body = {"model": TINY_NAME, "prompt": "Tell me a long story", "max_tokens": 50, "ignore_eos": True}
    disconnect_while_queued(url, loop, body, stream=False)
    settle(loop)
    gc.collect()
    asyncio.run(asyncio.sleep(0.3))  # the server's event loop runs the handlers of what was collected
    assert "never retrieved" not in caplog.text, caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
