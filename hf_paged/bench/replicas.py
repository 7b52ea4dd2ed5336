"""The ``replicas`` workload: multi-turn chats against ``hf-paged serve --data-parallel-size N`` on a local Ray
instance, prefix-aware routing against Ray Serve's default power-of-two choices.

``conversations`` closed-loop clients each hold one conversation of ``turns`` user turns (questions of
examples/data/chat_prompts.jsonl), starting 0.25 s apart; conversation i opens with system prompt
``i % system_prompts`` (60-70 tokens each), 1 s between a conversation's turns and every turn resends the whole history with the previous answers, as chat clients do. Answers are
greedy (``max_tokens`` each), so both routings generate the same tokens. Reported per routing: the prefix-cache
hit rate over all replicas (hits / queried prompt tokens, from ``/metrics``'s ``replica="total"`` lines),
generated tokens per second, how many requests each replica served, and the moves: turns answered by another
replica than their conversation's previous turn. Needs the ``ray`` extra.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections import Counter

from hf_paged.bench.common import load_chat_messages, machine_info

SYSTEM_PROMPTS = [
    "You are a patient science teacher for curious teenagers. Explain ideas with one concrete everyday example, "
    "define every technical word the first time you use it, prefer short sentences, and end with a question that "
    "checks understanding. Never invent facts; when unsure, say so plainly and suggest how to find out. ",
    "You are a careful travel and cooking assistant. Give practical answers in plain language, list steps in "
    "order, mention one common mistake to avoid, keep quantities metric, and stay polite and brief. If a request "
    "is unsafe or unclear, ask one clarifying question before answering anything else. ",
    "You are a friendly writing coach. Suggest clear structure, vivid but simple words and active voice; point out "
    "one strength and one thing to improve in every answer; keep your tone warm and your replies short. ",
]
ROUTINGS = ("pow2", "prefix")
ARRIVAL_GAP_S = 0.25  # between two conversations' first turns
# Between a conversation's turns. Without it a closed-loop client's next turn finds its last replica one request
# lighter (its own just finished) and power-of-two choices keeps it there: measured 2-8 of 80 turns moved.
THINK_S = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _totals(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if 'replica="total"' in line and not line.startswith("#"):
            out[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _conversations(n: int, turns: int, system_prompts: int) -> list[tuple[str, list[str]]]:
    questions = [m[-1]["content"] for m in load_chat_messages()]
    system = [SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)] for i in range(system_prompts)]
    return [(system[i % system_prompts], [questions[(i * turns + t) % len(questions)] for t in range(turns)])
            for i in range(n)]


async def _run_clients(url: str, model: str, conversations, max_tokens: int) -> tuple[int, float, Counter, int]:
    """Generated tokens, seconds, requests per replica, and the turns answered by another replica than the
    conversation's previous turn."""
    import httpx

    served: Counter = Counter()
    tokens = moves = 0

    async def client(http, index: int, system: str, questions: list[str]) -> None:
        nonlocal tokens, moves
        # Conversations arrive over a few seconds, as users do; all at once, whether requests that share a system
        # prompt find it cached would depend on which prefill step they land in more than on routing.
        await asyncio.sleep(ARRIVAL_GAP_S * index)
        history = [{"role": "system", "content": system}]
        previous = None
        for turn, q in enumerate(questions):
            if turn:  # the user reads the answer and types the next question
                await asyncio.sleep(THINK_S)
            history.append({"role": "user", "content": q})
            r = await http.post(url + "/v1/chat/completions", json={
                "model": model, "messages": history, "max_tokens": max_tokens, "temperature": 0})
            r.raise_for_status()
            body = r.json()
            replica = r.headers.get("x-hf-paged-replica", "?")
            served[replica] += 1
            moves += previous is not None and replica != previous
            previous = replica
            tokens += body["usage"]["completion_tokens"]
            history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(conversations))) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http, i, s, qs) for i, (s, qs) in enumerate(conversations)))
        return tokens, time.perf_counter() - start, served, moves


def _settled_metrics(url: str, replicas: int, after: float = 0.0) -> dict[str, float]:
    """``/metrics`` totals once every replica has reported after ``after`` (time.time())."""
    import httpx

    deadline = time.time() + 60
    while True:
        time.sleep(max(0.0, after + 2.5 - time.time()))  # replicas report every second
        text = httpx.get(url + "/metrics", timeout=30).text
        reporting = {line.split('replica="', 1)[1].split('"', 1)[0] for line in text.splitlines()
                     if line.startswith("hf_paged:prefix_cache_queries_total")} - {"total"}
        if len(reporting) >= replicas or time.time() > deadline:
            return _totals(text)
        after = time.time()


def _run_once(url: str, routing: str, num_replicas: int, work, dtype: str, max_num_seqs: int,
              max_tokens: int) -> dict:
    """Deploy the application with ``routing``, run the conversations, delete it."""
    from ray import serve

    from hf_paged.model.default_model import DEFAULT_MODEL_NAME
    from hf_paged.serving.ray_app import EngineSpec
    from hf_paged.serving.replicas import APP_NAME, build_application, wait_until_running

    spec = EngineSpec(dtype=dtype, engine_config={"max_num_seqs": max_num_seqs})
    serve.run(build_application(spec, num_replicas, routing=routing, replica_num_cpus=1), name=APP_NAME,
              route_prefix="/", blocking=False)
    wait_until_running(APP_NAME)
    before = _settled_metrics(url, num_replicas)
    tokens, seconds, served, moves = asyncio.run(_run_clients(url, DEFAULT_MODEL_NAME, work, max_tokens))
    after = _settled_metrics(url, num_replicas, time.time())
    serve.delete(APP_NAME)
    hits = after["hf_paged:prefix_cache_hits_total"] - before.get("hf_paged:prefix_cache_hits_total", 0)
    queries = after["hf_paged:prefix_cache_queries_total"] - before.get("hf_paged:prefix_cache_queries_total", 0)
    return {"routing": routing, "hit_rate": hits / max(queries, 1), "prompt_tokens": queries, "cached_tokens": hits,
            "generated_tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
            "requests_per_replica": sorted(served.values()), "moves": moves}


def replicas(dtype: str = "fp32", repeat: int = 1, systems: set[str] | None = None, num_replicas: int = 2,
             conversations: int = 16, turns: int = 6, max_tokens: int = 48, system_prompts: int = 2,
             max_num_seqs: int = 16) -> dict:
    import ray
    from ray import serve

    from hf_paged.model.default_model import DEFAULT_MODEL_NAME

    unknown = set(systems or ()) - set(ROUTINGS)
    if unknown:
        raise ValueError(f"replicas: unknown --systems {sorted(unknown)}; use {', '.join(ROUTINGS)}")
    chosen = [r for r in ROUTINGS if not systems or r in systems]
    work = _conversations(conversations, turns, system_prompts)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    results = {}
    ray.init(num_cpus=num_replicas, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for _ in range(max(1, repeat)):  # routings alternate (the machine's load drifts); every run is reported
            for routing in chosen:
                results.setdefault(routing, []).append(
                    _run_once(url, routing, num_replicas, work, dtype, max_num_seqs, max_tokens))
    finally:
        serve.shutdown()
        ray.shutdown()
    report = {"workload": "replicas", "dtype": dtype, "replicas": num_replicas, "conversations": conversations,
              "turns": turns, "max_tokens": max_tokens, "system_prompts": system_prompts, "machine": machine_info(),
              "results": results}
    print(f"replicas: {num_replicas} x {DEFAULT_MODEL_NAME} ({dtype}), {conversations} conversations x {turns} "
          f"turns, {system_prompts} system prompts, {max_tokens} new tokens per answer")
    print(f"{'routing':<8} {'hit rate':>9} {'cached/prompt tokens':>22} {'tok/s':>8} {'seconds':>8} {'moves':>6}  "
          "requests per replica")
    for r in [run for runs in results.values() for run in runs]:
        print(f"{r['routing']:<8} {r['hit_rate']:>9.1%} {int(r['cached_tokens']):>10}/{int(r['prompt_tokens']):<11} "
              f"{r['tok_per_s']:>8.1f} {r['seconds']:>8.1f} {r['moves']:>6}  {r['requests_per_replica']}")
    print(json.dumps(report))
    return report
