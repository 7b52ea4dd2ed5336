"""The ``serve`` workload: N concurrent streaming HTTP clients against ``hf-paged serve``, and in-process
``generate`` on the same requests, in one run.

For each level N (default 1, 16, 64) the first ``max(N, 16)`` chat prompts (at most 64) are answered
greedily (128 new tokens at most) by N closed-loop clients, each sending its next request when the previous
one ends; the in-process baseline runs the same prompts with ``max_num_seqs=N``. Needs the ``serve`` extra.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from hf_paged.bench.common import load_chat_messages, machine_info
from hf_paged.model.default_model import DEFAULT_MODEL_NAME

DEFAULT_CLIENTS = (1, 16, 64)
SYSTEMS = ("http", "generate")  # --systems: the server over HTTP, the same engine stepped in this process


@dataclass
class LevelResult:
    clients: int
    requests: int
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``hf-paged serve`` in a child process, on a free loopback port."""

    def __init__(self, dtype: str, max_num_seqs: int, timeout: float = 600.0) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "hf_paged.cli", "serve", "--port", str(self.port), "--dtype", dtype,
               "--max-num-seqs", str(max_num_seqs)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
        self._wait(timeout)

    def _wait(self, timeout: float) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hf-paged serve exited with {self.proc.returncode}: "
                                   f"{self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"hf-paged serve did not answer on {self.url} within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def http_level(url: str, conversations: list[list[dict]], clients: int, max_tokens: int,
                     model: str = DEFAULT_MODEL_NAME) -> LevelResult:
    """``clients`` concurrent streaming clients answer ``conversations`` (greedy); timings per chunk."""
    import httpx

    result = LevelResult(clients, len(conversations), texts=[""] * len(conversations))
    todo = list(range(len(conversations)))[::-1]
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "messages": conversations[i], "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        last = None
        parts = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:500]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"server error: {chunk['error']}")
                if chunk.get("usage"):
                    result.tokens += chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", ()):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            result.ttft.append(now - sent)
                        else:
                            result.itl.append(now - last)
                        last = now
                        parts.append(text)
        result.texts[i] = "".join(parts)

    async def worker(client: httpx.AsyncClient) -> None:
        while todo:
            await one(client, todo.pop())

    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        result.seconds = time.perf_counter() - start
    return result


def serve(dtype: str = "fp32", repeat: int = 1, systems: set[str] | None = None, clients: list[int] | None = None,
          num_requests: int | None = None, max_tokens: int | None = None, **_) -> dict:
    """Run the workload; prints a table and one JSON line, returns the JSON payload."""
    from hf_paged import SamplingParams
    from hf_paged.bench.workloads import run_engine
    from hf_paged.model.default_model import load_default, parse_dtype

    levels = list(clients or DEFAULT_CLIENTS)
    max_tokens = max_tokens or 128
    conversations = load_chat_messages()
    counts = {n: min(len(conversations), num_requests or max(n, 16)) for n in levels}
    want = systems or set(SYSTEMS)
    http: dict[int, LevelResult] = {}
    if "http" in want:
        server = ServerProcess(dtype, max_num_seqs=max(levels))
        try:
            asyncio.run(http_level(server.url, conversations[:2], 2, 4))  # warm-up
            for n in levels:
                runs = [asyncio.run(http_level(server.url, conversations[: counts[n]], n, max_tokens))
                        for _ in range(max(1, repeat))]
                http[n] = min(runs, key=lambda r: r.seconds)
        finally:
            server.stop()
    local: dict[int, tuple] = {}
    if "generate" in want:
        model, tok = load_default(parse_dtype(dtype))
        prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
                   for m in conversations]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        for n in levels:
            runs = [run_engine(model, prompts[: counts[n]], params, dict(max_num_seqs=n))
                    for _ in range(max(1, repeat))]
            res, outputs, _ = min(runs, key=lambda r: r[0].seconds)
            local[n] = (res, [tok.decode(o, skip_special_tokens=True) for o in outputs])
    return report(dtype, levels, counts, http, local)


def report(dtype: str, levels: list[int], counts: dict[int, int], http: dict[int, LevelResult], local: dict) -> dict:
    print(f"\n== hf-paged bench serve ({dtype}) ==")
    print(f"{'clients':>7} {'requests':>8} {'HTTP tok/s':>10} {'generate tok/s':>14} {'ratio':>6} "
          f"{'TTFT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} {'same text':>9}")
    rows = {}
    for n in levels:
        h, g = http.get(n), local.get(n)
        row = {"requests": counts[n]}
        if h is not None:
            row.update(http_tok_per_s=round(h.tok_per_s, 2), http_tokens=h.tokens, http_seconds=round(h.seconds, 3),
                       ttft_ms_p50=round(1000 * percentile(h.ttft, 50), 1),
                       ttft_ms_p99=round(1000 * percentile(h.ttft, 99), 1),
                       itl_ms_p50=round(1000 * percentile(h.itl, 50), 1),
                       itl_ms_p99=round(1000 * percentile(h.itl, 99), 1))
        if g is not None:
            row.update(generate_tok_per_s=round(g[0].tok_per_s, 2), generate_tokens=g[0].tokens)
        if h is not None and g is not None:
            row["ratio_http_over_generate"] = round(h.tok_per_s / g[0].tok_per_s, 3)
            row["same_text"] = f"{sum(a == b for a, b in zip(h.texts, g[1]))}/{counts[n]}"
        rows[n] = row

        def fmt(key: str, width: int, spec: str = ".1f") -> str:
            return f"{row[key]:>{width}{spec}}" if key in row else f"{'-':>{width}}"

        ttft = f"{row['ttft_ms_p50']:.0f}/{row['ttft_ms_p99']:.0f}" if h is not None else "-"
        itl = f"{row['itl_ms_p50']:.0f}/{row['itl_ms_p99']:.0f}" if h is not None else "-"
        print(f"{n:>7} {counts[n]:>8} {fmt('http_tok_per_s', 10)} {fmt('generate_tok_per_s', 14)} "
              f"{fmt('ratio_http_over_generate', 6, '.2f')} {ttft:>16} {itl:>15} {row.get('same_text', '-'):>9}")
    payload = {"workload": "serve", "dtype": dtype, "model": DEFAULT_MODEL_NAME, "levels": rows,
               "machine": machine_info()}
    print(json.dumps(payload))
    return payload
