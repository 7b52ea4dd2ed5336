"""The background engine loop (AsyncPagedEngine) on a tiny model: many concurrent callers, aborts, failures,
shutdown, the bounded queue, idling."""

import asyncio
import threading
import time

import psutil
import pytest

import hf_paged
from hf_paged import AsyncPagedEngine, EngineClosedError, PagedGenerator, QueueFullError, SamplingParams
from tests.helpers import make_model, make_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=11)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(32, seed=7)


@pytest.fixture(scope="module")
def alone(model, prompts):
    """Each prompt's greedy tokens from ``generate`` run alone."""
    engine = PagedGenerator(model, num_blocks=256, block_size=4)
    out = [engine.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    engine.close()
    return out


@pytest.fixture
def loop(model):
    engine_loop = AsyncPagedEngine(PagedGenerator(model, num_blocks=256, block_size=4, max_num_seqs=32))
    yield engine_loop
    engine_loop.shutdown()


def used_blocks(loop: AsyncPagedEngine) -> int:
    return loop.call(lambda e: e.kv_manager.num_used_blocks).result(10)


def test_32_threads_get_the_tokens_of_generate_alone(loop, prompts, alone):
    got: list = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def caller(i: int) -> None:
        barrier.wait()
        tokens = []
        for delta in loop.add_request(prompts[i], GREEDY):
            tokens += delta.token_ids
        got[i] = tokens

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == alone
    assert used_blocks(loop) == 0
    assert loop.num_finished_by_reason["length"] == len(prompts)


def test_32_asyncio_tasks_get_the_tokens_of_generate_alone(loop, prompts, alone):
    batch_sizes = []
    loop.add_observer(lambda info: batch_sizes.append(loop.last_batch_size))

    async def caller(i: int) -> list[int]:
        tokens = []
        async for delta in loop.add_request(prompts[i], GREEDY):
            tokens += delta.token_ids
        return tokens

    async def main():
        return await asyncio.gather(*(caller(i) for i in range(len(prompts))))

    assert asyncio.run(main()) == alone
    assert max(batch_sizes) > 1  # they really shared batches
    final = asyncio.run(loop.agenerate(prompts[0], GREEDY))  # the whole output at once
    assert final.finished and final.token_ids == alone[0]
    assert loop.generate(prompts[1], GREEDY).token_ids == alone[1]


def test_abort_mid_stream_frees_blocks(loop, prompts):
    stream = loop.add_request(prompts[0], LONG)
    it = iter(stream)
    first = next(it)
    assert not first.finished
    assert used_blocks(loop) > 0
    assert stream.abort()
    rest = list(it)
    assert rest[-1].finish_reason == "abort"
    assert used_blocks(loop) == 0
    assert not loop.abort(stream.request_id)  # finished: nothing to abort

    # leaving a sync iteration early aborts too
    for _ in loop.add_request(prompts[1], LONG):
        break
    deadline = time.time() + 10
    while used_blocks(loop) and time.time() < deadline:
        time.sleep(0.02)
    assert used_blocks(loop) == 0

    # and so does cancelling the asyncio task reading the stream
    async def read_forever(stream):
        async for _ in stream:
            pass

    async def main():
        stream = loop.add_request(prompts[2], LONG)
        task = asyncio.ensure_future(read_forever(stream))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return stream

    stream = asyncio.run(main())
    assert stream.result(10).finish_reason == "abort"
    assert used_blocks(loop) == 0
    assert loop.num_finished_by_reason["abort"] == 3


def test_abort_from_another_thread(loop, prompts):
    stream = loop.add_request(prompts[3], LONG, request_id="mine")
    threading.Timer(0.2, loop.abort, args=("mine",)).start()
    items = list(stream)
    assert items[-1].finish_reason == "abort" and sum(len(d.token_ids) for d in items) < LONG.max_tokens


@pytest.mark.parametrize("where", ["forward", "step"])
def test_a_failing_step_fails_only_its_requests(model, prompts, alone, where):
    engine = PagedGenerator(model, num_blocks=256, block_size=4, max_num_seqs=2)
    loop = AsyncPagedEngine(engine)
    try:
        running = [loop.add_request(prompts[i], LONG) for i in range(2)]
        for s in running:  # both are decoding
            it = iter(s)
            next(it)
            s._it = it
        target = engine.executor.runner if where == "forward" else engine
        original = target.execute if where == "forward" else target.step
        calls = {"n": 0}

        def broken(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("boom")
            return original(*args, **kwargs)

        setattr(target, "execute" if where == "forward" else "step", broken)
        later = loop.add_request(prompts[4], GREEDY)  # waiting (max_num_seqs=2) while the step fails
        for s in running:
            last = list(s._it)[-1]
            assert last.finish_reason == "error"
            assert "boom" in last.outputs[0].error and "engine step failed" in last.outputs[0].error
            assert len(s.last.token_ids) >= 1  # the tokens produced before the failure are kept
        assert later.result(60).token_ids == alone[4]  # the loop keeps serving
        assert loop.generate(prompts[5], GREEDY).token_ids == alone[5]
        assert used_blocks(loop) == 0
    finally:
        loop.shutdown()


def test_shutdown_with_requests_in_flight_loses_nothing(model, prompts):
    engine = PagedGenerator(model, num_blocks=256, block_size=4, max_num_seqs=2)
    loop = AsyncPagedEngine(engine)
    streams = [loop.add_request(p, LONG) for p in prompts[:6]]  # 2 running, 4 waiting
    next(iter(streams[0]))
    block = threading.Event()
    loop.call(lambda e: block.wait(10))  # hold the loop so that some requests are still in its inbox
    streams += [loop.add_request(p, LONG) for p in prompts[6:8]]
    block.set()
    loop.shutdown()
    for s in streams:
        out = s.result(10)
        assert out.finished and out.finish_reason == "abort", out
    assert list(streams[1])[-1].finish_reason == "abort"  # an unread stream still ends properly
    assert loop.num_finished_by_reason["abort"] == len(streams)
    assert engine._closed
    with pytest.raises(EngineClosedError):
        loop.add_request(prompts[0], GREEDY)
    with pytest.raises(EngineClosedError):
        loop.call(lambda e: None).result(1)
    loop.shutdown()  # twice is fine


def test_bounded_waiting_queue(model, prompts):
    loop = AsyncPagedEngine(PagedGenerator(model, num_blocks=256, block_size=4, max_num_seqs=1), max_waiting_requests=3)
    try:
        block = threading.Event()
        loop.call(lambda e: block.wait(10))
        streams = [loop.add_request(p, GREEDY) for p in prompts[:3]]
        with pytest.raises(QueueFullError, match="max_waiting_requests=3"):
            loop.add_request(prompts[3], GREEDY)
        block.set()
        assert all(s.result(60).finish_reason == "length" for s in streams)
        assert loop.generate(prompts[3], GREEDY).finished  # room again
    finally:
        loop.shutdown()


def test_add_requests_is_all_or_none_and_a_repeated_abort_counts_once(model, prompts):
    loop = AsyncPagedEngine(PagedGenerator(model, num_blocks=256, block_size=4, max_num_seqs=1), max_waiting_requests=3)
    seen = []
    loop.add_observer(lambda info: seen.extend(s.last.finish_reason for s in info.finished))
    try:
        block = threading.Event()
        loop.call(lambda e: block.wait(10))
        first = loop.add_request(prompts[0], LONG, request_id="first")
        with pytest.raises(QueueFullError, match="3 requests cannot be queued at once"):
            loop.add_requests(prompts[1:4], GREEDY)
        with pytest.raises(ValueError, match="vocabulary"):
            loop.add_requests([prompts[1], [10**6]], GREEDY)
        with pytest.raises(ValueError, match="never fit"):
            loop.add_requests(prompts[:4], GREEDY)
        assert loop.num_live_requests == 1  # nothing of a refused batch was queued
        assert loop.num_rejected == {"queue_full": 3, "engine_closed": 0, "engine_failed": 0}
        # the same abort twice before the loop drains either: one abort, which the observers see
        assert loop.abort("first") and loop.abort("first")
        block.set()
        assert first.result(30).finish_reason == "abort"
        loop.call(lambda e: None).result(30)  # after the step's observers
        assert seen == ["abort"] and loop.num_finished_by_reason["abort"] == 1
        both = loop.add_requests(prompts[1:3], GREEDY, ["a", "b"])
        assert [s.result(60).finish_reason for s in both] == ["length", "length"]
    finally:
        loop.shutdown()
    with pytest.raises(EngineClosedError):
        loop.add_requests(prompts[:2], GREEDY)
    assert loop.num_rejected == {"queue_full": 3, "engine_closed": 2, "engine_failed": 0}
    assert loop.num_finished_by_reason["abort"] == 1


def test_idle_loop_sleeps_and_wakes_on_new_work(loop, prompts, alone):
    assert loop.generate(prompts[0], GREEDY).token_ids == alone[0]
    native = loop._thread.native_id
    thread = next(t for t in psutil.Process().threads() if t.id == native)
    steps = loop.engine.num_steps
    time.sleep(0.6)
    after = next(t for t in psutil.Process().threads() if t.id == native)
    assert loop.engine.num_steps == steps  # no step without work
    assert (after.user_time + after.system_time) - (thread.user_time + thread.system_time) < 0.1  # no busy spin
    assert loop.generate(prompts[1], GREEDY).token_ids == alone[1]  # and it wakes up


def test_bad_input_raises_in_the_caller_and_changes_nothing(loop, prompts):
    with pytest.raises(ValueError, match="max_model_len"):
        loop.add_request([5] * 5000, GREEDY)
    with pytest.raises(TypeError, match="sampling_params"):
        loop.add_request(prompts[0], {"max_tokens": 3})
    with pytest.raises(ValueError, match="vocabulary"):
        loop.add_request([10**6], GREEDY)
    with pytest.raises(ValueError, match="n=64 samples exceed max_num_seqs=32"):
        loop.add_request(prompts[0], SamplingParams(n=64))
    stream = loop.add_request(prompts[0], LONG, request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        loop.add_request(prompts[1], GREEDY, request_id="dup")
    stream.abort()
    assert stream.result(10).finish_reason == "abort"
    assert loop.num_live_requests == 0
    with pytest.raises(ValueError, match="max_waiting_requests"):
        AsyncPagedEngine(loop.engine, max_waiting_requests=0)
    with pytest.raises(TypeError, match="PagedGenerator"):
        AsyncPagedEngine("engine")


def test_stream_is_read_once_and_n_samples_stream_together(loop, prompts):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3, ignore_eos=True)
    stream = loop.add_request(prompts[0], params)
    items = list(stream)
    with pytest.raises(RuntimeError, match="already being read"):
        list(stream)
    per_sample = [[t for d in items for t in d.outputs[i].token_ids] for i in range(3)]
    assert per_sample == [c.token_ids for c in stream.last.outputs]
    assert all(len(t) == 6 for t in per_sample)
    stats = loop.stats()
    assert stats.num_kv_blocks_used == 0 and stats.num_requests_finished >= 1


def test_exports():
    assert hf_paged.AsyncPagedEngine is AsyncPagedEngine
    assert hf_paged.QueueFullError is QueueFullError


def test_panel_snapshot_marks_shared_and_cached_blocks(loop, prompts):
    from hf_paged.ui.panel import render_panel, take_snapshot

    stream = loop.add_request(prompts[5] * 3, SamplingParams(max_tokens=300, temperature=1.0, n=2, seed=1,
                                                             ignore_eos=True), request_id="forked")
    it = iter(stream)
    next(it)
    next(it)  # forked: the two samples share the prompt's blocks
    snap = loop.call(take_snapshot).result(10)
    assert len(snap.owners) == loop.engine.kv_manager.num_blocks
    held = [o for o in snap.owners if o]
    assert held and all(o == ["forked"] for o in held)
    info = next(r for r in snap.requests if r.request_id == "forked")
    assert info.num_blocks == len(held)
    page = render_panel(snap, 12.5, 0, {"stop": 1})
    assert page.count("<i class='hfp-b") == len(snap.owners)
    assert "hfp-shared" in page and max(snap.refs) == 2
    assert "forked: running" in page and "12.5 tok/s" in page
    stream.abort()
    assert stream.result(10).finish_reason == "abort"
    snap = loop.call(take_snapshot).result(10)
    assert not any(snap.owners) and any(snap.cached)  # freed; full prompt blocks stay cached
    assert "hfp-cached" in render_panel(snap, 0.0, 0)


def test_per_request_speculation_through_the_loop(loop, prompts):
    """A request may turn speculation on (its own speculative_config) or off; greedy tokens never change."""
    prompt = prompts[3] * 4  # repetitive: n-gram drafts get accepted
    plain = loop.generate(prompt, GREEDY).outputs[0].token_ids
    before = loop.stats()
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    assert loop.generate(prompt, GREEDY, speculative_config=spec).outputs[0].token_ids == plain
    after = loop.stats()
    assert after.spec_num_drafts > before.spec_num_drafts
    off = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, num_speculative_tokens=0)
    assert loop.generate(prompt, off, speculative_config=spec).outputs[0].token_ids == plain
    assert loop.stats().spec_num_drafts == after.spec_num_drafts
    with pytest.raises(TypeError, match="unknown speculative_config"):
        loop.add_request(prompt, GREEDY, speculative_config={"method": "ngram", "k": 3})
    assert used_blocks(loop) == 0


def test_chat_demo_speculation_box(prompts):
    """The demo's speculative box drafts (n-gram) for its answer or not; the greedy answer is the same."""
    from hf_paged.ui.chat import ChatDemo
    from tests.serving_helpers import default_tokenizer, tiny_chat_model

    tok = default_tokenizer()
    engine_loop = AsyncPagedEngine(PagedGenerator(tiny_chat_model(tok), tok, num_blocks=256, max_num_seqs=4))
    try:
        demo = ChatDemo(engine_loop)
        assert not demo.engine_speculates
        answers, proposers = [], []
        for speculative in (False, True):
            *_, (shown, _conv, _box) = demo.respond("abc abc abc abc abc abc", [], "", 0.0, 1.0, 16, "s1",
                                                   speculative)
            answers.append(shown[-1]["content"])
            proposers.append(engine_loop.call(lambda e: list(e.executor.runner.speculator.proposers)).result(10))
        assert answers[0] == answers[1] and answers[0]
        assert proposers == [[], ["ngram:1:4"]]  # the box made this answer speculate (n-gram)
    finally:
        engine_loop.shutdown()


def test_a_long_prompt_arriving_beside_a_decode_is_chunked_and_exact(model):
    """long_prefill_token_threshold: a 100-token prompt that arrives while another request decodes is prefilled
    8 tokens a step (the threshold alone: no pacing); both answers equal stock greedy generate."""
    from tests.helpers import arrival_chunks, stock_greedy

    short, long = make_prompts(2, lengths=[5, 100], seed=3)
    engine = PagedGenerator(model, num_blocks=256, block_size=4, long_prefill_token_threshold=8, max_itl_ratio=None)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    chunks, done = arrival_chunks(engine, short, long, params)
    assert chunks == [8] * 12 + [4]
    assert done["short"] == stock_greedy(model, short, 20)
    assert done["long"] == stock_greedy(model, long, 20)


def test_the_queue_count_is_current_when_a_stream_gets_its_output(model, prompts):
    """What the schema fuzz found: the loop updated its waiting count after handing a step's outputs to the
    streams, so a client that sent its next request right after its answer was measured against the previous
    step's queue (a spurious 503 queue_full on an empty queue). Record ``num_waiting`` at every output: a request
    that has a token is no longer waiting, so the count can never exceed the requests without one."""
    loop = AsyncPagedEngine(PagedGenerator(model, num_blocks=256, block_size=4, max_num_seqs=4),
                            max_waiting_requests=8)
    gate = threading.Event()
    busy = loop.call(lambda e: gate.wait(30))  # all 8 are admitted together: 4 run, 4 wait
    streams = loop.add_requests(prompts[:8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    seen: list[tuple[int, int]] = []  # (num_waiting, requests with no token yet) at each output
    started: set[str] = set()

    def recording(stream):
        put = stream.put

        def wrapped(item):
            if any(c.token_ids for c in item.outputs):
                started.add(stream.request_id)
            seen.append((loop.num_waiting, len(streams) - len(started)))
            put(item)
        return wrapped

    for stream in streams:
        stream.put = recording(stream)
    gate.set()
    busy.result(30)
    for stream in streams:
        stream.result(60)
    loop.shutdown()
    assert len(started) == 8
    assert all(waiting <= unstarted for waiting, unstarted in seen), seen
