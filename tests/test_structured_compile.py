"""One client's grammar compile never holds up the others (issue #40, item 2).

xgrammar cannot stop a compile, and some schemas compile for minutes (optional properties: ~n^3). Each new spec
is tried in a child process under ``structured_compile_timeout_s``; past it the request is a ValueError / 400
naming the budget, and a client that leaves stops its compile. On the server, compiles run on their own thread,
not on the request workers that parse everyone's requests.

SLOW is a schema of 1,000 optional properties: ~12 s to compile on a 2-core dev machine (at least ~3 s on a fast
one), far past the budgets used here, so every test stops it within a second or two.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("xgrammar")

from hf_paged.config import EngineConfig  # noqa: E402
from hf_paged.structured.compile_worker import CompileCancelled  # noqa: E402
from hf_paged.structured.compiler import GrammarCompilerCache  # noqa: E402
from hf_paged.structured_params import StructuredOutputsParams  # noqa: E402
from tests.serving_helpers import TINY_NAME, StreamTimer, default_tokenizer, serve, tiny_chat_model  # noqa: E402


def slow_schema(prefix: str) -> dict:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "string"} for i in range(1000)}}


SMALL = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read().lower()


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def test_the_budget_refuses_a_slow_spec_and_cancel_stops_one(tok):
    cache = GrammarCompilerCache(tok, len(tok), [tok.eos_token_id], compile_timeout_s=1.0)
    try:
        cache.warm()  # starts the child, without waiting for it
        first = cache.worker.pid
        assert first is not None and _alive(first)
        assert cache.compile(StructuredOutputsParams(json=SMALL)) is not None and cache.worker.pid == first
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"structured_compile_timeout_s=1 s.*raise the budget.*"
                                             r"--structured-compile-timeout-s"):
            cache.compile(StructuredOutputsParams(json=slow_schema("p")))
        assert time.monotonic() - start < 4.0  # the budget, not the ~12 s compile
        assert cache.worker.num_timeouts == 1 and not _alive(first) and cache.worker.pid != first
        start = time.monotonic()
        with pytest.raises(ValueError, match="structured_compile_timeout_s"):  # refused again at once
            cache.compile(StructuredOutputsParams(json=slow_schema("p")))
        assert time.monotonic() - start < 0.5 and cache.worker.num_timeouts == 1

        cache.compile(StructuredOutputsParams(regex="[a-z]+"))  # waits for the replacement child to be ready
        running = cache.worker.pid
        cancel, when = threading.Event(), []

        def cancel_while_compiling() -> None:  # jsonschema checks the schema first (seconds): wait for the child
            while cache.worker.busy_since is None:
                time.sleep(0.01)
            time.sleep(0.3)
            when.append(time.monotonic())
            cancel.set()

        threading.Thread(target=cancel_while_compiling, daemon=True).start()
        with pytest.raises(CompileCancelled):
            cache.compile(StructuredOutputsParams(json=slow_schema("q")), cancel)
        assert time.monotonic() - when[0] < 0.5  # stopped at the cancel, before the 1 s budget
        assert cache.worker.num_cancelled == 1 and cache.worker.num_timeouts == 1 and not _alive(running)
        with pytest.raises(ValueError, match=r"invalid structured_outputs.regex: Regex parsing error"):
            cache.compile(StructuredOutputsParams(regex="[a-z"))  # xgrammar's own error, from the child
    finally:
        cache.close()
    assert cache.worker.pid is None


def test_the_setting_is_checked_and_wired_to_the_cli():
    from hf_paged.cli import build_parser

    assert EngineConfig().structured_compile_timeout_s is None  # a Python caller owns its process: no child
    assert EngineConfig(structured_compile_timeout_s=0).structured_compile_timeout_s == 0
    with pytest.raises(ValueError, match="structured_compile_timeout_s must be a finite number of seconds >= 0"):
        EngineConfig(structured_compile_timeout_s=-1)
    with pytest.raises(TypeError, match="structured_compile_timeout_s must be a number of seconds or None"):
        EngineConfig(structured_compile_timeout_s="5")
    args = build_parser().parse_args(["serve", "--structured-compile-timeout-s", "2.5"])
    assert args.structured_compile_timeout_s == 2.5
    for command in ("serve", "chat"):  # a server protects its other clients by default
        assert build_parser().parse_args([command]).structured_compile_timeout_s == 20.0


@pytest.fixture(scope="module")
def server(tok):
    with serve(tiny_chat_model(tok), tok, TINY_NAME, max_num_seqs=4, structured_compile_timeout_s=2.0) as (url, loop):
        body = {"model": TINY_NAME, "prompt": "Hi", "max_tokens": 2, "guided_json": SMALL}
        assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 200  # the child is up
        yield url, loop


def test_big_schemas_hold_up_neither_streams_nor_plain_requests(server):
    """Two clients send a schema over the budget while a stream runs; a plain request sent meanwhile answers at
    its normal pace (before, both request workers compiled for the schemas' whole ~12 s and it waited for one)."""
    url, _ = server
    body = {"model": TINY_NAME, "prompt": "Once", "max_tokens": 900, "ignore_eos": True, "temperature": 0,
            "stream": True}
    timer = StreamTimer(url, "/v1/completions", body).start()
    chunk_times = timer.chunk_times
    plain = {"model": TINY_NAME, "prompt": "Hello", "max_tokens": 4}
    t = time.perf_counter()
    assert httpx.post(url + "/v1/completions", json=plain, timeout=60).status_code == 200
    alone = time.perf_counter() - t
    big = {"model": TINY_NAME, "messages": [{"role": "user", "content": "Fill it"}], "max_tokens": 4,
           "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": slow_schema("p")}}}
    results: list[httpx.Response] = []
    big_start = time.perf_counter()
    senders = [threading.Thread(target=lambda: results.append(
        httpx.post(url + "/v1/chat/completions", json=big, timeout=120)), daemon=True) for _ in range(2)]
    for sender in senders:
        sender.start()
    time.sleep(0.3)  # both are parsed and compiling (before: on both request workers)
    t = time.perf_counter()
    assert httpx.post(url + "/v1/completions", json=plain, timeout=60).status_code == 200
    during = time.perf_counter() - t
    for sender in senders:
        sender.join(60)
    big_end = time.perf_counter()
    timer.stop()
    assert during < max(1.5, 5 * alone), f"a plain request took {during:.2f} s during the compile ({alone:.2f} s alone)"
    assert [r.status_code for r in results] == [400, 400]
    error = results[0].json()["error"]
    assert error["param"] == "response_format" and error["code"] == "grammar_too_complex"
    assert "structured_compile_timeout_s=2 s" in error["message"] and "raise the budget" in error["message"]
    assert big_end - big_start < 8.0  # the budget stopped the first, the second was refused at once
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:]) if big_start < a and b < big_end]
    assert len(gaps) >= 20, f"the stream got {len(gaps)} chunks while the schemas compiled"
    assert sorted(gaps)[int(0.9 * len(gaps))] < 0.25, f"the stream's inter-token gaps: {sorted(gaps)[-5:]}"


def test_a_client_that_leaves_stops_its_compile(server):
    url, loop = server
    worker = loop.engine._grammar_cache().worker
    worker.timeout_s = 60.0  # only the disconnect can stop it now
    try:
        httpx.post(url + "/v1/completions", json={"model": TINY_NAME, "prompt": "Hi", "max_tokens": 2,
                                                    "guided_regex": "[0-9]+"}, timeout=120)  # replacement child ready
        cancelled, pid = worker.num_cancelled, worker.pid
        body = {"model": TINY_NAME, "prompt": "Fill it", "max_tokens": 4, "guided_json": slow_schema("r")}
        payload = json.dumps(body).encode()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        client = socket.create_connection((host, int(port)), timeout=60)
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % (host.encode(), len(payload)) + payload)
        # the client leaves once its grammar is compiling in the child (a fixed wait left, on a slow host, before
        # the compile had started: nothing to stop then)
        deadline = time.monotonic() + 60
        while worker.busy_since is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.busy_since is not None, "the schema never reached the compile child"
        client.close()
        deadline = time.monotonic() + 15
        while (worker.num_cancelled == cancelled or _alive(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.num_cancelled == cancelled + 1 and not _alive(pid), "the compile outlived its client"
        used = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(1.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime
        assert cpu < 0.5, f"the server kept {cpu:.2f} s of CPU busy in the second after the client left"
    finally:
        worker.timeout_s = 2.0
