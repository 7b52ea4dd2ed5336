"""A bounded soak of the OpenAI server (issue #29): 2,000 mixed requests (``tests/soak.py``: completions and
chat, streaming and not, n > 1, stop strings, clients that disconnect mid-stream or give up, bad bodies) from
16 concurrent clients against a live server on loopback with a tiny random model and short answers. Every
answer must be the right one (200 with every choice finished, or the bad body's 4xx; never a 5xx), and
afterwards the engine must be idle and whole: no request running or waiting, no KV block held (blocks that
only keep a cached prefix are free), the block accounting consistent, and the process's resident memory
within 10% of where it was after warm-up.

``HF_PAGED_SOAK_REQUESTS`` sets the number of requests (default 2000); ``python -m tests.soak`` runs the same
load against any live server (see its docstring).
"""

import asyncio
import gc
import json
import os
import time
from collections import Counter

import httpx
import psutil
import pytest

from tests.serving_helpers import TINY_NAME, default_tokenizer, scrape, serve, tiny_chat_model, wait_until
from tests.soak import make_specs, run_load

REQUESTS = int(os.environ.get("HF_PAGED_SOAK_REQUESTS", "2000"))
WARM_UP = 200


@pytest.fixture(scope="module")
def server_for_streams():
    tok = default_tokenizer()
    with serve(tiny_chat_model(tok), tok, TINY_NAME, num_blocks=64, max_num_seqs=4) as (url, _):
        yield url


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def test_soak_leaves_no_request_no_block_and_no_growth():
    tok = default_tokenizer()
    with serve(tiny_chat_model(tok), tok, TINY_NAME, num_blocks=256, max_num_seqs=8, max_model_len=128,
               max_waiting_requests=64) as (url, loop):
        specs = make_specs(REQUESTS, TINY_NAME)
        start = time.perf_counter()
        tally = asyncio.run(run_load(url, specs[:WARM_UP], concurrency=16))
        wait_until(lambda: loop.num_live_requests == 0, what="idle after warm-up")
        rss_warm = rss()
        asyncio.run(run_load(url, specs[WARM_UP:], concurrency=16, tally=tally))
        seconds = time.perf_counter() - start
        wait_until(lambda: loop.num_live_requests == 0, what="no live request after the soak")
        rss_end = rss()

        assert not tally.failures, "\n".join(tally.failures[:20])
        assert sum(tally.by_kind.values()) == REQUESTS
        assert not [s for s in tally.statuses if s >= 500], tally.statuses
        assert tally.disconnects >= REQUESTS // 20, tally  # the mix really cut streams off
        stats = loop.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
        assert stats.num_kv_blocks_used == 0, f"{stats.num_kv_blocks_used} blocks held after the soak"
        assert stats.num_kv_blocks_cached > 0  # the shared prefix stayed cached (free, reusable)
        loop.call(lambda e: (e.kv_manager.check_consistency(), e.scheduler.check_consistency())).result(30)
        finished = loop.num_finished_by_reason
        assert finished["error"] == 0
        # every answered prompt finished in the engine; a disconnect is one abort at most (or none, when the
        # client hung up after the end or before its request was submitted)
        # every answered completion finished in the engine, and each one a client cut off finished at most once
        # (aborted, or finished before the client hung up, or never submitted when it hung up before that)
        assert tally.completions <= sum(finished.values()) <= tally.completions + tally.cut_off
        assert 0 < finished["abort"] <= tally.cut_off
        # the metrics count engine requests (one per prompt; cut-off requests have n = 1): one abort each
        assert scrape(url)["hf_paged:request_success_total{finished_reason=abort}"] == finished["abort"]
        assert rss_end <= 1.10 * rss_warm, f"RSS grew from {rss_warm / 2**20:.0f} to {rss_end / 2**20:.0f} MiB"
        print(f"soak: {REQUESTS} requests in {seconds:.1f} s, {dict(tally.by_kind)}, statuses {dict(tally.statuses)}, "
              f"{tally.disconnects} disconnects, {finished}, RSS {rss_warm / 2**20:.0f} -> {rss_end / 2**20:.0f} MiB")


def test_a_streamed_choice_finishes_once_when_its_siblings_run_on(server_for_streams):
    """What the soak found: with n > 1, a choice that finished before its siblings was sent again, with its
    finish_reason, in every later event of the stream (3 or 4 finishes for n = 2)."""
    url = server_for_streams
    uneven = 0
    for seed in range(6):
        body = {"model": TINY_NAME, "prompt": "the quick brown fox", "n": 2, "max_tokens": 12, "temperature": 1.0,
                "seed": seed, "stop": ["e"], "stream": True}
        finishes, lengths = Counter(), Counter()
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        lengths[c["index"]] += 1
                        finishes[c["index"]] += c["finish_reason"] is not None
        assert finishes == {0: 1, 1: 1}, (seed, finishes)
        uneven += lengths[0] != lengths[1]
    assert uneven, "no seed made the two choices finish at different steps: the test checks nothing"
