"""The replicated server on Ray Serve, end to end: a local Ray instance on loopback (started once for the module),
two replicas of a tiny random model behind the ingress, HTTP through Ray's proxy.

Each engine replica loads ``tiny_chat_loader`` (the tests' tiny Llama with the default tokenizer); the driver
builds the same model to compute what one engine answers.
"""

import concurrent.futures
import json
import logging
import socket
import time

import httpx
import pytest
import ray
from ray import serve

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.serving.protocol import apply_chat_template
from hf_paged.serving.ray_app import REPLICA_HEADER, EngineSpec
from hf_paged.serving.replicas import APP_NAME, build_application, wait_until_running
from tests.serving_helpers import TINY_NAME, tiny_chat_loader, wait_until


@pytest.fixture(scope="module")
def url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=4, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec = EngineSpec(loader=tiny_chat_loader, served_model_name=TINY_NAME, engine_config={"max_num_seqs": 16})
        app = build_application(spec, 2, health_check_period_s=1.0, report_period=0.25, replica_num_cpus=1)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        wait_until_running(APP_NAME, timeout=240)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = tiny_chat_loader()
    return PagedGenerator(model, tokenizer, max_num_seqs=16), tokenizer


def post(url: str, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + path, json={"model": TINY_NAME, **body}, timeout=timeout)


def metric(text: str, name: str, replica: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'replica="{replica}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def engine_replicas() -> set[str]:
    return {a["name"].rsplit("#", 1)[1] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#Engine#")}


def test_two_replicas_answer_16_concurrent_requests_as_one_engine(url, engine):
    generator, tokenizer = engine
    questions = [f"Question {i}: what is {i} + {i}?" for i in range(16)]
    chats = [[{"role": "user", "content": q}] for q in questions]  # 16 prefixes: both replicas get some
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want = [o.text for o in generator.generate([apply_chat_template(tokenizer, c) for c in chats], params,
                                               use_tqdm=False)]

    def ask(chat: list[dict]) -> httpx.Response:
        return post(url, "/v1/chat/completions", {"messages": chat, "max_tokens": 24, "temperature": 0})

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(ask, chats))
    assert [r.status_code for r in responses] == [200] * 16
    assert [r.json()["choices"][0]["message"]["content"] for r in responses] == want
    assert {r.headers[REPLICA_HEADER] for r in responses} == engine_replicas()  # both served (one: 2 in 2**16)

    # streaming through the ingress: the same text, OpenAI's events, the replica named in a header
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "model": TINY_NAME, "messages": chats[3], "max_tokens": 24, "temperature": 0,
            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == want[3]


def test_errors_and_other_routes_pass_through(url):
    r = post(url, "/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(url + "/v1/completions", content=b"{not json", timeout=60)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"] == TINY_NAME
    assert httpx.get(url + "/health", timeout=60).json() == {"status": "ok"}
    assert httpx.get(url + "/nowhere", timeout=60).status_code == 404


def test_a_client_that_leaves_mid_stream_aborts_its_request(url):
    def aborted() -> float:
        for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
            if (line.startswith("hf_paged:request_success_total{") and 'finished_reason="abort"' in line
                    and 'replica="total"' in line):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = aborted()
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
            "model": TINY_NAME, "prompt": "Talk for a long time:", "max_tokens": 900, "ignore_eos": True,
            "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    # the ingress cancels the replica's call, the replica's app sees the disconnect and aborts the request
    wait_until(lambda: aborted() == before + 1, timeout=20, what="the abandoned stream's abort in /metrics")


def test_requests_sharing_a_prefix_land_on_one_replica_and_hit_its_cache(url):
    system = "You are the prefix routing test. " * 16  # ~130 tokens: seven whole KV blocks shared
    first = post(url, "/v1/chat/completions", {"messages": [{"role": "system", "content": system},
                                                            {"role": "user", "content": "Hello 0"}], "max_tokens": 4})
    home = first.headers[REPLICA_HEADER]
    wait_until(lambda: metric(httpx.get(url + "/metrics", timeout=30).text, "hf_paged:prompt_tokens_total", home) > 0,
               what="the first request's replica in /metrics")
    before = httpx.get(url + "/metrics", timeout=30).text
    served = []
    for i in range(1, 7):
        r = post(url, "/v1/chat/completions", {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Hello {i}"}],
            "max_tokens": 4})
        assert r.status_code == 200
        served.append(r.headers[REPLICA_HEADER])
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96
    assert served == [home] * 6  # power-of-two choices would split them

    def hits_grew() -> bool:
        after = httpx.get(url + "/metrics", timeout=30).text
        grew = (metric(after, "hf_paged:prefix_cache_hits_total", home)
                - metric(before, "hf_paged:prefix_cache_hits_total", home))
        return grew >= 6 * 96

    wait_until(hits_grew, what="the prefix cache hits of the home replica in /metrics")
    text = httpx.get(url + "/metrics", timeout=30).text
    per_replica = sum(metric(text, "hf_paged:prefix_cache_hits_total", r) for r in engine_replicas())
    assert metric(text, "hf_paged:prefix_cache_hits_total", "total") == per_replica


def kill_replica(replica: str) -> None:
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#Engine#{replica}", namespace="serve"), no_restart=True)


def test_a_request_whose_replica_dies_before_answering_is_retried_once(url):
    prompt = "Retry me: " * 8
    home = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).headers[REPLICA_HEADER]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # same prefix: same replica, then it dies
        pending = pool.submit(post, url, "/v1/completions", {"prompt": prompt, "max_tokens": 900, "ignore_eos": True,
                                                             "temperature": 0})
        time.sleep(0.5)
        assert not pending.done()
        kill_replica(home)
        r = pending.result()
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] != home
    assert r.json()["usage"]["completion_tokens"] == 900


def test_a_killed_replica_is_replaced_and_the_others_keep_serving(url):
    wait_until(lambda: len(engine_replicas()) == 2, timeout=120, what="two engine replicas")
    wait_until_running(APP_NAME, timeout=120)
    # a long stream; its replica is killed mid-answer
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
            "model": TINY_NAME, "prompt": "Count forever:", "max_tokens": 900, "ignore_eos": True,
            "temperature": 0, "stream": True}) as r:
        victim = r.headers[REPLICA_HEADER]
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        kill_replica(victim)
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == "replica_died" and "died mid-answer" in error["message"]

    # the survivor answers at once, the dead replica's prefixes included; Ray starts a replacement
    for i in range(4):
        r = post(url, "/v1/completions", {"prompt": "Count forever:", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] != victim
    wait_until(lambda: len(engine_replicas() - {victim}) == 2, timeout=120, what="a replacement replica")
    wait_until_running(APP_NAME, timeout=120)
    deadline, seen = time.time() + 60, set()
    while len(seen) < 2 and time.time() < deadline:  # both replicas answer again
        r = post(url, "/v1/completions", {"prompt": f"Fresh prompt {len(seen)} {time.time()}", "max_tokens": 2})
        assert r.status_code == 200
        seen.add(r.headers[REPLICA_HEADER])
        time.sleep(0.2)
    assert seen == engine_replicas() and victim not in seen
