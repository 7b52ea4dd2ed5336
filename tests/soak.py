"""A soak load for the OpenAI server: many mixed requests from concurrent clients, every answer checked.

The mix (seeded, so a run is repeatable): completions and chat, plain and streaming, ``n`` > 1, stop strings
and stop token ids, log-probabilities, several prompts in one call, prompts sharing a prefix (prefix-cache
hits), clients that disconnect mid-stream or give up on a plain request, bad bodies (each must get its 4xx),
and ``/health`` / ``/metrics`` reads. ``tests/test_server_soak.py`` runs it against an in-process server and
then checks the engine's own block accounting; run it against any live server for longer::

    hf-paged serve --port 8000 --max-num-seqs 16 &
    python -m tests.soak http://127.0.0.1:8000 --requests 100000 --concurrency 32 --pid $!

which ends by reading ``/metrics`` (no request running or waiting, no KV block in use) and, with ``--pid``,
the server's resident memory after warm-up and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = ("the quick brown fox jumps over a lazy dog while seven tired wizards count blue stars near "
         "an old river and quiet people sing about tea bread rain snow light").split()
SHARED = "You are a careful assistant. Answer in one short sentence, and never mention the weather. "


@dataclass
class Spec:
    """One request of the soak and what it must get back."""

    kind: str  # plain, stream, disconnect_stream, disconnect_plain, bad, get
    method: str
    path: str
    body: object = None  # a JSON value, or bytes sent as they are
    expect: tuple[int, ...] = (200,)
    min_chunks: int = 0  # disconnect_stream: events read before hanging up
    give_up: float = 0.0  # disconnect_plain: seconds before the client gives up


@dataclass
class Tally:
    """What came back."""

    by_kind: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    completions: int = 0  # prompts x n of the requests answered 200 (each finished in the engine)
    disconnects: int = 0  # requests the client hung up on
    cut_off: int = 0  # their prompts x n (each finished in the engine, or never submitted)
    failures: list[str] = field(default_factory=list)


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _sampling(rng: random.Random, model: str, max_tokens: int) -> dict:
    body: dict = {"model": model, "max_tokens": rng.randint(1, max_tokens)}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, top_p=0.9, seed=rng.randint(0, 10**6))
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.2:
        body["stop"] = rng.choice([" the", ["a", "o"], "\n"])
    if rng.random() < 0.1:
        body["stop_token_ids"] = [rng.randint(0, 200)]
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    return body


def _prompt(rng: random.Random) -> str:
    return (SHARED if rng.random() < 0.4 else "") + _text(rng, 1, 12)


BAD: list[tuple[object, str, tuple[int, ...]]] = [  # (body, route, statuses)
    (b"{not json", "/v1/completions", (400,)),
    (b"[1, 2, 3]", "/v1/chat/completions", (400,)),
    (b"[" * 100 + b"]" * 100, "/v1/completions", (400,)),
    ({"prompt": "hi", "max_tokens": 0}, "/v1/completions", (400,)),
    ({"prompt": "hi", "n": 99}, "/v1/completions", (400,)),
    ({"prompt": "hi", "temperature": "hot"}, "/v1/completions", (400,)),
    ({"prompt": "hi", "stop": [""]}, "/v1/completions", (400,)),
    ({"prompt": [10**9]}, "/v1/completions", (400,)),
    ({"prompt": "hi", "model": "no-such-model"}, "/v1/completions", (404,)),
    ({"messages": []}, "/v1/chat/completions", (400,)),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "/v1/chat/completions", (400,)),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, "/v1/chat/completions", (400,)),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {}}, "/v1/chat/completions", (400,)),
    ({"prompt": "x" * (5 * 2**20)}, "/v1/completions", (413,)),
]


def make_specs(count: int, model: str, seed: int = 29, max_tokens: int = 8) -> list[Spec]:
    """``count`` requests of the mix, in a seeded order."""
    rng = random.Random(seed)
    kinds = ["plain"] * 30 + ["stream"] * 25 + ["disconnect_stream"] * 10 + ["disconnect_plain"] * 5 + \
            ["bad"] * 20 + ["get"] * 10
    specs = []
    for _ in range(count):
        kind = rng.choice(kinds)
        chat = rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if kind == "get":
            specs.append(Spec(kind, "GET", rng.choice(["/health", "/metrics", "/v1/models"])))
            continue
        if kind == "bad":
            body, path, expect = rng.choice(BAD)
            specs.append(Spec(kind, "POST", path, {"model": model, **body} if isinstance(body, dict) else body,
                              expect))
            continue
        body = _sampling(rng, model, max_tokens)
        if chat:
            body["messages"] = [{"role": "user", "content": _prompt(rng)}]
        elif rng.random() < 0.15:
            body["prompt"] = [_prompt(rng) for _ in range(2)]
        else:
            body["prompt"] = _prompt(rng)
        if rng.random() < 0.15:
            body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
        if kind.startswith("disconnect"):  # long enough to be cut off mid-answer
            body.update(max_tokens=48, ignore_eos=True)
            body.pop("n", None)
        if kind in ("stream", "disconnect_stream"):
            body["stream"] = True
            if rng.random() < 0.3:
                body["stream_options"] = {"include_usage": True}
        specs.append(Spec(kind, "POST", path, body, min_chunks=rng.randint(1, 3),
                          give_up=rng.uniform(0.01, 0.3)))
    return specs


def _prompts(body: dict) -> int:
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else 1


def _completions(body: dict) -> int:
    return _prompts(body) * body.get("n", 1)


async def _send(http: httpx.AsyncClient, spec: Spec, tally: Tally) -> None:
    tally.by_kind[spec.kind] += 1
    raw = spec.body if isinstance(spec.body, bytes) else None
    kwargs = {"content": raw, "headers": {"content-type": "application/json"}} if raw is not None else \
        ({"json": spec.body} if spec.body is not None else {})
    if spec.kind == "disconnect_plain":
        try:
            await asyncio.wait_for(http.request(spec.method, spec.path, **kwargs), spec.give_up)
        except asyncio.TimeoutError:
            tally.disconnects += 1
            tally.cut_off += _completions(spec.body)
            return
        tally.completions += _completions(spec.body)  # it finished before the client gave up
        return
    if spec.kind in ("stream", "disconnect_stream"):
        events = []
        async with http.stream(spec.method, spec.path, **kwargs) as r:
            tally.statuses[r.status_code] += 1
            if r.status_code != 200:
                tally.failures.append(f"{spec.kind} {spec.path}: {r.status_code} {(await r.aread())[:300]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if spec.kind == "disconnect_stream" and len(events) >= spec.min_chunks:
                    tally.disconnects += 1
                    tally.cut_off += _completions(spec.body)
                    return  # leaving the block closes the connection mid-stream
        if events[-1:] != ["[DONE]"] or any('"error"' in e[:12] for e in events):
            tally.failures.append(f"stream {spec.path}: ended {events[-2:]!r}")
            return
        chunks = [json.loads(e) for e in events[:-1]]
        finished = sum(c["finish_reason"] is not None for chunk in chunks for c in chunk["choices"])
        if finished != _completions(spec.body):
            tally.failures.append(f"stream {spec.path}: {finished} choices finished, body {spec.body!r}")
        tally.completions += _completions(spec.body)
        return
    r = await http.request(spec.method, spec.path, **kwargs)
    tally.statuses[r.status_code] += 1
    if r.status_code not in spec.expect:
        tally.failures.append(f"{spec.kind} {spec.method} {spec.path}: {r.status_code} (expected {spec.expect}) "
                              f"{r.text[:300]!r}")
        return
    if spec.kind == "bad":
        error = r.json()["error"]
        if not error["message"] or "type" not in error:
            tally.failures.append(f"bad {spec.path}: {r.text[:300]!r}")
    elif spec.kind == "plain":
        answer = r.json()
        if len(answer["choices"]) != _completions(spec.body):
            tally.failures.append(f"plain {spec.path}: {len(answer['choices'])} choices for {spec.body!r}")
        tally.completions += _completions(spec.body)


async def run_load(url: str, specs: list[Spec], concurrency: int = 16, tally: Tally | None = None,
                   timeout: float = 60.0) -> Tally:
    """Send ``specs`` from ``concurrency`` clients (each its own connection pool); every answer is checked."""
    tally = tally or Tally()
    queue: asyncio.Queue = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
            while not queue.empty():
                spec = queue.get_nowait()
                try:
                    await _send(http, spec, tally)
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    tally.failures.append(f"{spec.kind} {spec.path}: {type(e).__name__}: {e}")

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return tally


def _rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    import psutil

    return psutil.Process(pid).memory_info().rss


def _metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0) + sample.value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--model", help="the served model's id (default: the server's /v1/models)")
    p.add_argument("--max-tokens", type=int, default=8, help="most new tokens of a request that runs to its end")
    p.add_argument("--seed", type=int, default=29)
    p.add_argument("--pid", type=int, help="the server's process id: compare its memory after warm-up and at the end")
    args = p.parse_args(argv)
    url = args.url.rstrip("/")
    model = args.model or httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    specs = make_specs(args.requests, model, args.seed, args.max_tokens)
    warm = min(len(specs) // 10, 500)
    start = time.perf_counter()
    tally = asyncio.run(run_load(url, specs[:warm], args.concurrency))
    time.sleep(1.0)
    rss_warm = _rss(args.pid)
    asyncio.run(run_load(url, specs[warm:], args.concurrency, tally))
    seconds = time.perf_counter() - start
    deadline = time.time() + 60
    while True:
        metrics = _metrics(url)
        idle = metrics.get("hf_paged:num_requests_running", 0) + metrics.get("hf_paged:num_requests_waiting", 0)
        if (idle == 0 and metrics.get("hf_paged:kv_cache_usage_perc", 0) == 0) or time.time() > deadline:
            break
        time.sleep(0.5)
    rss_end = _rss(args.pid)
    print(f"{len(specs)} requests in {seconds:.1f} s ({len(specs) / seconds:.1f}/s): {dict(tally.by_kind)}; "
          f"statuses {dict(tally.statuses)}; {tally.disconnects} disconnects; {len(tally.failures)} failures")
    for failure in tally.failures[:20]:
        print("  failure:", failure)
    print(f"after: running {metrics.get('hf_paged:num_requests_running')}, waiting "
          f"{metrics.get('hf_paged:num_requests_waiting')}, KV usage {metrics.get('hf_paged:kv_cache_usage_perc')}")
    ok = not tally.failures and idle == 0 and metrics.get("hf_paged:kv_cache_usage_perc", 0) == 0
    if rss_warm is not None:
        print(f"server RSS: {rss_warm / 2**20:.0f} MiB after warm-up, {rss_end / 2**20:.0f} MiB at the end")
        ok = ok and rss_end <= 1.1 * rss_warm
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
