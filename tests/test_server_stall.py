"""One client never stalls the others (issue #29, item 1): request bodies are parsed, templated and tokenized
on worker threads, not on the server's event loop. A tokenizer whose chat template takes DELAY seconds on a
huge message stands in for a slow tokenizer; while it runs, /health answers at once and a concurrent stream
keeps receiving tokens (on an event-loop tokenizer both wait the whole DELAY)."""

import asyncio
import threading
import time

import httpx
import pytest

from hf_paged import AsyncPagedEngine, PagedGenerator
from hf_paged.serving.common import QueueFullError, WorkerPool
from hf_paged.serving.protocol import ServedModel
from hf_paged.serving.server import BackgroundServer, build_app
from tests.serving_helpers import TINY_NAME, StreamTimer, default_tokenizer, scrape, tiny_chat_model

DELAY = 2.0  # seconds the slow template takes on a huge message
HUGE = 3 * 2**20  # characters of the huge message


class SlowTemplate:
    """The default tokenizer, but its chat template takes DELAY seconds on a message over 1 MiB (and returns
    more ids than any context, so the request ends in a 400 without tokenizing megabytes for real)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def apply_chat_template(self, messages, **kw):
        if sum(len(m["content"]) for m in messages) > 2**20:
            time.sleep(DELAY)
            return [1] * 100_000
        return self._tokenizer.apply_chat_template(messages, **kw)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def server():
    tok = default_tokenizer()
    loop = AsyncPagedEngine(PagedGenerator(tiny_chat_model(tok), tok, num_blocks=256, max_num_seqs=4))
    served = ServedModel(TINY_NAME, SlowTemplate(tok), loop.max_model_len, 4)
    background = BackgroundServer(build_app(loop, served)).start()
    try:
        yield background.url
    finally:
        background.stop()
        loop.shutdown()


def test_a_huge_message_stalls_neither_streams_nor_cheap_requests(server):
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 950, "ignore_eos": True, "temperature": 0, "stream": True}
    timer = StreamTimer(server, "/v1/chat/completions", body).start()
    chunk_times = timer.chunk_times
    huge: dict = {}

    def send_huge() -> None:
        body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "x" * HUGE}], "max_tokens": 4}
        huge["start"] = time.perf_counter()
        huge["status"] = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).status_code
        huge["end"] = time.perf_counter()

    sender = threading.Thread(target=send_huge, daemon=True)
    sender.start()
    health = []
    with httpx.Client(base_url=server, timeout=30) as http:
        while sender.is_alive():
            t = time.perf_counter()
            assert http.get("/health").status_code == 200
            health.append(time.perf_counter() - t)
            time.sleep(0.02)
    sender.join()
    timer.stop()
    assert huge["status"] == 400  # too long for the context, after the slow template ran
    assert huge["end"] - huge["start"] >= DELAY
    assert len(health) >= 10 and max(health) < DELAY / 4, f"/health took up to {max(health):.2f} s"
    during = [t for t in chunk_times if huge["start"] + 0.5 < t < huge["end"] - 0.5]
    assert len(during) >= 10, f"the stream got {len(during)} chunks in the middle {DELAY - 1:.1f} s of the stall"


def test_worker_pool_bounds_its_queue():
    async def main() -> None:
        pool = WorkerPool(workers=1, max_pending=2)
        gate = threading.Event()
        first = asyncio.ensure_future(pool.run(gate.wait, 30))
        second = asyncio.ensure_future(pool.run(lambda: 7))
        await asyncio.sleep(0.05)
        assert pool.num_pending == 2
        with pytest.raises(QueueFullError, match="2 requests are being prepared"):
            await pool.run(lambda: 0)
        second.cancel()  # waiting for the one worker: never runs
        gate.set()
        assert await first is True
        assert await pool.run(lambda: 5) == 5 and pool.num_pending == 0
        with pytest.raises(ZeroDivisionError):
            await pool.run(lambda: 1 / 0)
        pool.close()

    asyncio.run(main())
    with pytest.raises(ValueError, match="workers must be a positive int, got 0"):
        WorkerPool(workers=0)


class GatedTemplate(SlowTemplate):
    """The default tokenizer, but its chat template waits for ``gate`` on a message saying "wait"."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.entered, self.gate = threading.Event(), threading.Event()

    def apply_chat_template(self, messages, **kw):
        if messages[-1]["content"] == "wait":
            self.entered.set()
            self.gate.wait(60)
        return self._tokenizer.apply_chat_template(messages, **kw)


def test_a_full_worker_pool_is_a_503_counted_as_a_queue_full_rejection():
    tok = default_tokenizer()
    template = GatedTemplate(tok)
    loop = AsyncPagedEngine(PagedGenerator(tiny_chat_model(tok), tok, num_blocks=64, max_num_seqs=2),
                            max_waiting_requests=1)  # so the pool admits one request being parsed
    served = ServedModel(TINY_NAME, template, loop.max_model_len, 2)
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "wait"}], "max_tokens": 2}
    rejected = "hf_paged:requests_rejected_total{reason=queue_full}"
    try:
        with BackgroundServer(build_app(loop, served, request_workers=1)) as background:
            first = threading.Thread(target=lambda: httpx.post(background.url + "/v1/chat/completions", json=body,
                                                               timeout=60), daemon=True)
            first.start()
            assert template.entered.wait(30)
            r = httpx.post(background.url + "/v1/chat/completions", json={**body, "messages": [
                {"role": "user", "content": "hi"}]}, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
            assert "being prepared" in r.json()["error"]["message"]
            template.gate.set()
            first.join(60)
            assert scrape(background.url)[rejected] == 1
            assert loop.num_rejected["queue_full"] == 0  # the engine never saw it
            assert scrape(background.url)["hf_paged:request_success_total{finished_reason=abort}"] == 0
    finally:
        template.gate.set()
        loop.shutdown()
