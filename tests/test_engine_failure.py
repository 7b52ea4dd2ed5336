"""An engine that fails for good (its executor is gone: a tensor-parallel worker died) behind the OpenAI server: one
short line to every client, ``/health`` 503, one log line, and the exit watch that lets a supervisor restart the
server. A fake executor fails here on demand (fast); tests/test_tensor_parallel.py kills a real worker rank of a
real ``hf-paged serve``."""

import json
import logging
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from hf_paged.serving.http_runner import ENGINE_FAILURE_EXIT_CODE, _ExitOnEngineFailure
from tests.serving_helpers import TINY_NAME, default_tokenizer, scrape, serve, tiny_chat_model, wait_until

REASON = "a tensor-parallel worker exited (rank 1, killed by SIGKILL)"
BODY = {"model": TINY_NAME, "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 500,
        "ignore_eos": True, "temperature": 0}


class DyingExecutor:
    """The engine's executor until :meth:`die`; then what a tensor-parallel group whose worker died does: every
    step raises the collective's error (a library path in it), and ``failure`` says why in one line."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.failure = None
        self.dead = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def die(self) -> None:
        self.dead.set()

    def check_health(self):
        if self.dead.is_set():
            self.failure = REASON
        return self.failure

    def execute_model(self, out):
        if self.dead.is_set():
            self.failure = REASON
            raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection reset by peer")
        return self.inner.execute_model(out)


@pytest.fixture
def dying():
    """A server whose engine runs on a :class:`DyingExecutor`; yields ``(url, loop, executor)``."""
    tok = default_tokenizer()
    with serve(tiny_chat_model(tok), tok, TINY_NAME, num_blocks=128, max_num_seqs=4) as (url, loop):
        executor = loop.call(lambda e: DyingExecutor(e.executor)).result(30)
        loop.call(lambda e: setattr(e, "executor", executor)).result(30)
        yield url, loop, executor


def _errors(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_failure_mid_stream_is_one_short_line_to_every_client_and_one_in_the_log(dying, caplog):
    url, loop, executor = dying
    caplog.set_level(logging.WARNING)
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                if not events:
                    executor.die()
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    message = json.loads(events[-2])["error"]["message"]
    assert message == f"engine failed: {REASON}"  # not the collective's error, with its path
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and health.json() == {"status": "engine failed", "error": message}
    for stream in (False, True):  # refused at once, never queued
        later = httpx.post(url + "/v1/chat/completions", json={**BODY, "stream": stream}, timeout=30)
        assert later.status_code == 503 and later.headers["retry-after"] == "1"
        assert later.json()["error"] == {"message": message, "type": "server_error", "param": None,
                                         "code": "engine_failed"}
    assert loop.failure == message and loop.wait_for_failure(0) == message
    assert loop.num_rejected["engine_failed"] == 2
    assert scrape(url)["hf_paged:requests_rejected_total{reason=engine_failed}"] == 2
    errors = _errors(caplog)
    assert [r.getMessage() for r in errors] == [f"{message}; every request fails from now on"]
    assert not any(r.exc_info for r in caplog.records)  # no traceback, per request or at all


def test_a_failure_while_idle_is_found_without_a_request(dying, caplog):
    url, loop, executor = dying
    caplog.set_level(logging.WARNING)
    assert loop.wait_for_failure(0.1) is None
    executor.die()
    started = time.monotonic()
    wait_until(lambda: httpx.get(url + "/health").status_code == 503, timeout=10, what="/health 503")
    assert time.monotonic() - started < 5  # the idle loop's health check, once a second
    assert loop.wait_for_failure(10) == f"engine failed: {REASON}"
    assert len(_errors(caplog)) == 1 and not any(r.exc_info for r in caplog.records)


def test_the_exit_watch_stops_the_server_after_the_grace_period():
    failed = threading.Event()
    engine = SimpleNamespace(wait_for_failure=lambda: failed.wait() and f"engine failed: {REASON}")
    server = SimpleNamespace(should_exit=False)
    exits = []
    watch = _ExitOnEngineFailure(engine, server, grace_s=0.3, hard_exit_after_s=0.3, exit=exits.append)
    time.sleep(0.2)
    assert not watch.fired and not server.should_exit  # a healthy engine: nothing happens
    failed.set()
    started = time.monotonic()
    wait_until(lambda: server.should_exit, timeout=10, what="the server told to stop")
    assert watch.fired and time.monotonic() - started >= 0.25  # it answered 503s for the grace period first
    assert not exits
    wait_until(lambda: exits, timeout=10, what="the hard exit")  # a stop that hangs still ends the process
    assert exits == [ENGINE_FAILURE_EXIT_CODE] == [1]
