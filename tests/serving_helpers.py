"""Servers for the serving tests: the default model, and a tiny random model with the default tokenizer."""

from __future__ import annotations

import contextlib
import time

from hf_paged import AsyncPagedEngine, PagedGenerator
from hf_paged.serving.protocol import ServedModel
from hf_paged.serving.server import BackgroundServer, build_app
from tests.helpers import make_model

TINY_NAME = "tiny-llama"


def default_tokenizer():
    from transformers import AutoTokenizer

    from hf_paged.model.default_model import default_model_path

    return AutoTokenizer.from_pretrained(str(default_model_path()))


def tiny_chat_model(tokenizer):
    """A tiny random Llama whose vocabulary is the default tokenizer's (so it has text and a chat template)."""
    return make_model("llama", seed=21, vocab_size=len(tokenizer))


@contextlib.contextmanager
def serve(model, tokenizer, name: str, *, api_key: str | None = None, max_waiting_requests: int = 1024,
          max_prompts: int | None = None, **config):
    """An engine loop and an OpenAI server on a free loopback port; yields ``(url, loop)``."""
    loop = AsyncPagedEngine(PagedGenerator(model, tokenizer, **config), max_waiting_requests=max_waiting_requests)
    served = ServedModel(name, tokenizer, loop.max_model_len, loop.engine.config.max_num_seqs, max_prompts=max_prompts)
    server = BackgroundServer(build_app(loop, served, api_key=api_key)).start()
    try:
        yield server.url, loop
    finally:
        server.stop()
        loop.shutdown()


def wait_until(condition, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def used_blocks(loop: AsyncPagedEngine) -> int:
    return loop.call(lambda e: e.kv_manager.num_used_blocks).result(30)


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as ``{sample name with labels: value}``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def tiny_chat_loader():
    """``(tiny_chat_model, default tokenizer)``: what each Ray Serve engine replica of the tests loads."""
    tokenizer = default_tokenizer()
    return tiny_chat_model(tokenizer), tokenizer


class StreamTimer:
    """A streaming request read on a background thread, recording when each data chunk arrived (for the tests
    that check a running stream keeps its pace while something else happens on the server)."""

    def __init__(self, base_url: str, path: str, body: dict) -> None:
        import threading

        self.chunk_times: list[float] = []
        self._started, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._read, args=(base_url, path, body), daemon=True)

    def _read(self, base_url: str, path: str, body: dict) -> None:
        import httpx

        with httpx.Client(base_url=base_url, timeout=60) as http, http.stream("POST", path, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.chunk_times.append(time.perf_counter())
                    self._started.set()
                if self._stop.is_set():
                    break

    def start(self) -> StreamTimer:
        self._thread.start()
        assert self._started.wait(60), "the stream never started"
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
