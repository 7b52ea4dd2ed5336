"""Tensor parallelism on torch.distributed (gloo, 2 processes on loopback): exact greedy parity with stock
generate and the one-process engine, the engine's features on top, faults and start-up errors.

Every engine here spawns one worker process (a few seconds each): the cases share engines where they can."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.executor.multiproc import TensorParallelError
from hf_paged.executor.tensor_parallel import head_split
from tests.helpers import make_model, make_prompts, stock_greedy

NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _workers() -> list[int]:
    """This process's spawned children that are tensor-parallel workers (not multiprocessing's resource tracker)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
    found = []
    for pid in map(int, out.split()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


@pytest.fixture(autouse=True)
def no_process_left():
    yield
    deadline = time.monotonic() + 10
    while _workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _workers(), "a worker process was left behind"
    assert not dist.is_initialized()


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_parity_with_stock_generate_and_one_process(arch):
    """GQA (llama: 4 query / 2 KV heads), q/k/v biases (qwen2), a 48-token sliding window (mistral, prompts up
    to 90 tokens); chunked prefill (a 32-token step budget) runs beside decodes."""
    model = make_model(arch)
    prompts = make_prompts(5, [3, 20, 49, 70, 90], seed=3)
    want = [stock_greedy(model, p, NEW) for p in prompts]
    single = PagedGenerator(model, num_blocks=80, max_num_batched_tokens=32)
    assert _tokens(single.generate(prompts, GREEDY, use_tqdm=False)) == want
    fused = single.fused is not None
    single.close()
    engine = PagedGenerator(model, tensor_parallel_size=2, num_blocks=80, max_num_batched_tokens=32)
    assert engine.pool.specs[0].num_kv_heads == 1  # each rank holds its own KV head
    assert (engine.fused is not None) == fused  # the fused CPU layers run o/down as modules: the all-reduce hooks run
    assert _tokens(engine.generate(prompts, GREEDY, use_tqdm=False)) == want
    engine.kv_manager.check_consistency()
    assert engine.kv_manager.num_used_blocks == 0
    assert engine.executor.comm_seconds > 0
    engine.close()


@pytest.mark.parametrize("arch,settings", [
    ("llama", dict(quantization="int8")),
    ("qwen2", dict(quantization="int4", kv_cache_dtype="int8")),
    ("mistral", dict(decode_runner="native", prepack_weights="native")),
    ("llama", dict(decode_runner="static", prepack_weights=False)),
    ("qwen2", dict(speculative_config=dict(method="draft_model", model="self:1", num_speculative_tokens=2),
                   decode_runner="native", prepack_weights="native")),
], ids=["int8", "int4-kv8", "native-program", "static-buckets", "self-draft"])
def test_composes_with_quantization_and_fast_step_runners(arch, settings):
    """The collectives are part of the layers (ParallelLinear), so each rank quantizes its slices and replays its
    steps on the native program or decode buckets, and the tokens are the one-process engine's."""
    from hf_paged.model.layers.quant_linear import QuantLinear
    from hf_paged.model.layers.parallel import ParallelLinear

    model = make_model(arch)
    prompts = make_prompts(4, [3, 20, 49, 70], seed=5)
    single = PagedGenerator(model, num_blocks=80, max_num_batched_tokens=32, **settings)
    want = _tokens(single.generate(prompts, GREEDY, use_tqdm=False))
    single.close()
    engine = PagedGenerator(model, tensor_parallel_size=2, num_blocks=80, max_num_batched_tokens=32, **settings)
    assert _tokens(engine.generate(prompts, GREEDY, use_tqdm=False)) == want
    shard = engine.executor.model
    parallel = [m for m in shard.modules() if type(m) is ParallelLinear]
    assert len(parallel) == 2 * model.config.num_hidden_layers + 1  # o/down of every layer, and the LM head
    if "quantization" in settings:
        assert all(type(m.base) is QuantLinear for m in parallel)  # the slices quantized inside their layers
    fast = engine.executor.runner.fast
    if settings.get("decode_runner") == "native":
        assert type(fast).__name__ == "DecodeProgram" and fast.num_runs > 0
    if settings.get("decode_runner") == "static":
        assert type(fast).__name__ == "DecodeBuckets" and fast.num_replays > 0
    if "speculative_config" in settings:  # the draft forwards ran the first layer's shard on every rank
        assert engine.stats().spec_num_draft_tokens > 0
    engine.close()


def test_prefix_caching_n_samples_and_speculative_decoding():
    model = make_model("llama")
    shared = make_prompts(1, [40], seed=5)[0]
    prompts = [shared + [7, 8, 9], shared + [10, 11]]
    repeat = [p * 3 for p in make_prompts(2, [8, 15], seed=6)]  # n-gram lookups find matches
    draft = make_model("llama", seed=1)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=11, n=3)
    results = {}
    for tp in (1, 2):
        engine = PagedGenerator(model, tensor_parallel_size=tp, num_blocks=120, block_size=8)
        first = _tokens(engine.generate(prompts[:1], GREEDY, use_tqdm=False))
        second = _tokens(engine.generate(prompts[1:], GREEDY, use_tqdm=False))
        hits = engine.stats().prefix_cache_hits
        samples = [c.token_ids for c in engine.generate([prompts[0]], sampled, use_tqdm=False)[0].outputs]
        spec = {}
        for name, cfg in (("ngram", dict(method="ngram", num_speculative_tokens=3)),
                          ("draft", dict(method="draft_model", model=draft, num_speculative_tokens=2))):
            ids = [engine.add_request(p, GREEDY, speculative_config=cfg) for p in repeat]
            done = {}
            while engine.has_unfinished_requests():
                done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            spec[name] = [done[i] for i in ids]
        stats = engine.stats()
        engine.kv_manager.check_consistency()
        assert engine.kv_manager.num_used_blocks == 0
        engine.close()
        results[tp] = first, second, samples, spec
        assert hits > 0 and stats.spec_num_draft_tokens > 0
    first, second, samples, spec = results[2]
    assert first + second == [stock_greedy(model, p, NEW) for p in prompts]
    assert spec["ngram"] == spec["draft"] == [stock_greedy(model, p, NEW) for p in repeat]
    assert samples == results[1][2] and len({tuple(s) for s in samples}) > 1  # seeded samples: the same draws


def test_beam_search_and_swap_preemption():
    """Beams share blocks (copy-on-write on every rank's pool); a pool too small for all requests swaps them out
    to host memory and back, on every rank."""
    from hf_paged import BeamSearchParams

    model = make_model("mistral")
    prompts = make_prompts(6, [30, 41, 52, 35, 60, 44], seed=8)
    beams = BeamSearchParams(beam_width=3, max_tokens=6)
    got = {}
    for tp in (1, 2):
        engine = PagedGenerator(model, tensor_parallel_size=tp, block_size=8, num_blocks=36, preemption_mode="swap",
                                swap_space=2**22, max_itl_ratio=None)
        greedy = _tokens(engine.generate(prompts, GREEDY, use_tqdm=False))
        preempted = engine.stats().num_preemptions.get("swap", 0)
        searched = [[b.token_ids for b in out.sequences] for out in engine.beam_search(prompts[:2], beams)]
        engine.kv_manager.check_consistency()
        assert engine.kv_manager.num_used_blocks == 0
        engine.close()
        got[tp] = greedy, searched
        assert preempted > 0
    assert got[2][0] == [stock_greedy(model, p, NEW) for p in prompts]
    assert got[2][1] == got[1][1]


def test_openai_server_on_a_tensor_parallel_engine():
    openai = pytest.importorskip("openai")
    from tests.serving_helpers import TINY_NAME, default_tokenizer, serve, tiny_chat_model

    tokenizer = default_tokenizer()
    model = tiny_chat_model(tokenizer)
    messages = [{"role": "user", "content": "Name three colors."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = stock_greedy(model, ids, 8)
    threads = torch.get_num_threads()
    with serve(model, tokenizer, TINY_NAME, tensor_parallel_size=2, num_blocks=64) as (url, loop):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=8, temperature=0)
        assert reply.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
        chunks = client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=8, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    # rank 0 shares the cores with its worker only while it works: built here, stepped and closed on the loop's
    # thread, the engine leaves this thread's count as it was (it once left it at cores / 2)
    assert torch.get_num_threads() == threads


def test_default_model_from_pretrained():
    """The default model (9 query / 3 KV heads: split 3 + 6 over 2 ranks) loaded by every rank from its folder."""
    from hf_paged.model.default_model import default_model_path, load_default

    model, tokenizer = load_default()
    chats = [[{"role": "user", "content": c}] for c in ("What is the capital of France?", "Write a haiku about rain.")]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in chats]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [stock_greedy(model, p, 10) for p in prompts]
    engine = PagedGenerator.from_pretrained(str(default_model_path()), tokenizer, tensor_parallel_size=2, num_blocks=64)
    assert [s.num_kv_heads for s in engine.pool.specs[:1]] == [1]
    assert _tokens(engine.generate(prompts, params, use_tqdm=False)) == want
    engine.close()


def test_a_killed_worker_fails_the_requests_and_shuts_the_group_down():
    model = make_model("llama")
    engine = PagedGenerator(model, tensor_parallel_size=2, num_blocks=40, distributed_timeout=20)
    engine.add_request(make_prompts(1, [10])[0], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
                       request_id="a")
    engine.step()
    worker = engine.executor.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    started = time.monotonic()
    outs = []
    while engine.has_unfinished_requests() and time.monotonic() - started < 30:
        outs += engine.step()
    assert time.monotonic() - started < 10
    (out,) = [o for o in outs if o.finished]
    assert out.outputs[0].finish_reason == "error"
    with pytest.raises(TensorParallelError, match="rank 1"):
        engine.executor.execute_model(engine.scheduler.schedule())
    later = engine.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]  # fails at once: the group is gone
    assert later.outputs[0].finish_reason == "error"
    engine.close()
    assert not worker.is_alive()


def test_bad_configurations_are_refused_before_any_process_starts():
    model = make_model("llama")  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        PagedGenerator(model, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 is more than the model's 2 key/value heads"):
        PagedGenerator(model, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="decode_runner='inductor' cannot be used with tensor_parallel_size > 1"):
        PagedGenerator(model, tensor_parallel_size=2, decode_runner="inductor")
    with PagedGenerator(model, num_blocks=16, quantization="int8"):  # its int8 layers live while it does
        with pytest.raises(ValueError, match="another engine on this model quantized its linears"):
            PagedGenerator(model, tensor_parallel_size=2)
    with pytest.raises(TypeError, match="needs tensor_parallel_size > 1"):
        PagedGenerator("/no/such/folder")
    assert head_split(9, 3, 2) == [(0, 3, 0, 1), (3, 9, 1, 3)]  # uneven: the default model's 3 KV heads
    assert head_split(4, 2, 4) == [(0, 1, 0, 1), (1, 2, 0, 1), (2, 3, 1, 2), (3, 4, 1, 2)]  # KV heads replicated


def test_start_up_errors_name_the_rank_and_the_cause(monkeypatch):
    model = make_model("llama")
    # a shard that does not fit: every rank's pool is too small for max_model_len
    with pytest.raises(TensorParallelError, match=r"rank 0: building its executor \(KV pool, kernels\) failed: "
                                                  r"ValueError: max_model_len=900.*rank 1: building its executor"):
        PagedGenerator(model, tensor_parallel_size=2, num_blocks=4, block_size=16, max_model_len=900)
    # the rendezvous port is taken
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 0: .*127\.0\.0\.1:\d+.*(in use|EADDRINUSE)"):
            PagedGenerator(model, tensor_parallel_size=2, num_blocks=40, distributed_timeout=10)
        assert time.monotonic() - started < 30


def test_torchrun_launch_two_ranks(tmp_path):
    """Under torchrun every rank runs the same script; rank 0 drives the engine, rank 1 serves as a worker."""
    model = make_model("qwen2")
    model.save_pretrained(tmp_path / "m")
    prompt = make_prompts(1, [30], seed=9)[0]
    want = stock_greedy(model, prompt, NEW)
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        from hf_paged import PagedGenerator, SamplingParams
        engine = PagedGenerator.from_pretrained({str(tmp_path / "m")!r}, tokenizer=None, tensor_parallel_size=2,
                                                num_blocks=40)
        out = engine.generate([{prompt!r}], SamplingParams(max_tokens={NEW}, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)
        print("TOKENS", out[0].outputs[0].token_ids, flush=True)
        engine.close()
    """))
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS")]
    assert line == f"TOKENS {want}"


@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("llama", True)])
def test_a_rank_reads_only_its_shard_from_the_folder(tmp_path, arch, tie):
    """A rank builds empty modules and reads its slices from the safetensors file: the same tensors as slicing
    the loaded model, and about half the bytes of the full model (embeddings and norms are replicated)."""
    from hf_paged.executor.shard_loading import ModelSource

    model = make_model(arch, tie_word_embeddings=tie)
    model.save_pretrained(tmp_path)
    full_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for rank in (0, 1):
        from_folder = ModelSource(path=str(tmp_path)).load_shard(rank, 2).state_dict()
        from_memory = ModelSource.of(model).load_shard(rank, 2).state_dict()
        assert from_folder.keys() == from_memory.keys()
        for name, tensor in from_folder.items():
            assert torch.equal(tensor, from_memory[name]), name
        shard_bytes = sum(t.numel() * t.element_size() for t in from_folder.values())
        embed = model.get_input_embeddings().weight
        assert shard_bytes < 0.5 * full_bytes + embed.numel() * embed.element_size() + 4096


def test_workers_die_with_a_killed_rank_zero(tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent("""
        import time
        from hf_paged import PagedGenerator
        from tests.helpers import make_model
        if __name__ == "__main__":  # spawned workers import this module again
            engine = PagedGenerator(make_model("llama"), tensor_parallel_size=2, num_blocks=40)
            print("WORKER", engine.executor.processes[0].pid, flush=True)
            time.sleep(120)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()}, cwd=os.getcwd())
    try:
        line = proc.stdout.readline()
        assert line.startswith("WORKER"), line
        worker = int(line.split()[1])
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{worker}"), "the worker outlived its rank 0"
    finally:
        proc.kill()


def test_a_script_without_a_main_guard_fails_fast_with_the_reason(tmp_path):
    """Spawned ranks import the user's script again; one that builds the engine at top level makes the worker
    fail while starting: rank 0 reports that at once (not after the group's timeout)."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        from hf_paged import PagedGenerator
        from tests.helpers import make_model
        PagedGenerator(make_model("llama"), tensor_parallel_size=2, num_blocks=40, distributed_timeout=60)
    """))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()}, cwd=os.getcwd())
    assert proc.returncode != 0
    assert "before joining the group" in proc.stderr and "__main__" in proc.stderr
    assert time.monotonic() - started < 45


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_on_two_gpus(tmp_path):
    model = make_model("llama")
    model.save_pretrained(tmp_path)
    prompts = make_prompts(3, [5, 30, 60], seed=2)
    want = [stock_greedy(model, p, NEW) for p in prompts]
    engine = PagedGenerator.from_pretrained(str(tmp_path), tokenizer=False, device="cuda", tensor_parallel_size=2,
                                            num_blocks=40)
    assert engine.pool.device.type == "cuda"
    assert _tokens(engine.generate(prompts, GREEDY, use_tqdm=False)) == want
    engine.close()


def test_a_ray_replica_spec_builds_a_tensor_parallel_engine(tmp_path):
    """``hf-paged serve --data-parallel-size M --tensor-parallel-size N``: each replica builds its engine from the
    folder with every rank loading its shard (the same code runs inside a Ray Serve replica)."""
    from hf_paged.executor.multiproc import TensorParallelExecutor
    from hf_paged.serving.ray_app import EngineSpec
    from tests.serving_helpers import tiny_chat_loader

    model, tokenizer = tiny_chat_loader()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    want = stock_greedy(model, prompt, 6)
    spec = EngineSpec(model=str(tmp_path), engine_config={"tensor_parallel_size": 2, "num_blocks": 64})
    loop, _ = spec.build_app()
    try:
        assert isinstance(loop.engine.executor, TensorParallelExecutor)
        got = loop.call(lambda e: e.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                             use_tqdm=False)[0].outputs[0].token_ids).result(120)
        assert got == want
    finally:
        loop.shutdown()
        loop.engine.close()


def test_int8_kv_cache_under_tensor_parallelism():
    """Each rank's pool stores its KV heads as int8 rows with their scales: the same tokens as one process's int8
    pool (unpaced, so both chunk the prompts alike)."""
    model = make_model("llama")
    prompts = make_prompts(4, [5, 17, 60, 90], seed=4)
    got = {}
    for tp in (1, 2):
        engine = PagedGenerator(model, tensor_parallel_size=tp, num_blocks=64, kv_cache_dtype="int8", max_itl_ratio=None)
        assert engine.pool.cache_dtype == torch.int8
        got[tp] = _tokens(engine.generate(prompts, GREEDY, use_tqdm=False))
        engine.close()
    assert got[2] == got[1]


def _spawned_children(pid: int) -> list[int]:
    """The tensor-parallel workers a process spawned (not multiprocessing's resource tracker)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    found = []
    for child in map(int, out.split()):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(child)
    return found


def test_a_server_whose_worker_dies_says_so_and_exits_for_its_supervisor(tmp_path):
    """``hf-paged serve --tensor-parallel-size 2`` with its worker rank killed: the request in flight ends with one
    short line (no library paths), ``/health`` answers 503, new requests a short 503, the log holds no traceback,
    and the process exits with status 1 after the grace period, so that a supervisor restarts it."""
    import httpx

    from tests.serving_helpers import TINY_NAME, default_tokenizer, tiny_chat_model

    tokenizer = default_tokenizer()
    folder = tmp_path / TINY_NAME
    tiny_chat_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    grace = 4.0
    cmd = [sys.executable, "-m", "hf_paged.cli", "serve", "--model", str(folder), "--tensor-parallel-size", "2",
           "--port", str(port), "--max-num-seqs", "4", "--exit-grace-seconds", str(grace)]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "HF_PAGED_TUNE": "0", "OMP_NUM_THREADS": "1"}
    log = tmp_path / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        workers = _spawned_children(proc.pid)
        assert len(workers) == 1, workers
        body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "Count to a thousand."}],
                "max_tokens": 600, "ignore_eos": True, "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not events:  # generation is under way: kill the worker rank
                    os.kill(workers[0], signal.SIGKILL)
                events.append(line[6:])
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["message"].startswith("engine failed: a tensor-parallel worker exited (rank 1"), error
        assert "/" not in error["message"] and ".cc" not in error["message"], error
        failed_at = time.monotonic()
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "engine failed", health.text
        later = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=30)
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_failed", later.text
        assert later.json()["error"]["message"] == health.json()["error"] == error["message"]
        assert proc.wait(grace + 30) == 1
        assert time.monotonic() - failed_at >= grace / 2  # it answered for the grace period first
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]
        assert text.count("engine failed: a tensor-parallel worker exited") == 2, text  # the loop's line, the exit's
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in workers:
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not os.path.exists(f"/proc/{pid}"), "a worker outlived its server"


def test_sharded_quantized_model_equals_one_process():
    """A model quantized for good (quantize_model; a GGUF file kept is the same QuantLinear layers) shards its bytes:
    rows of q/k/v, gate/up and the LM head, the column blocks of o/down (their int8 row scales whole), and gives
    the one-process engine's tokens on every rank's native decode program."""
    from hf_paged import quantize_model

    prompts = make_prompts(4, [3, 20, 49, 70], seed=5)
    for arch, quantization in (("llama", "int4"), ("qwen2", "int8")):
        model = quantize_model(copy.deepcopy(make_model(arch)), quantization)  # a copy: make_model's is shared
        one = PagedGenerator(model, num_blocks=80, max_num_batched_tokens=32)
        want = _tokens(one.generate(prompts, GREEDY, use_tqdm=False))
        one.close()
        engine = PagedGenerator(model, tensor_parallel_size=2, num_blocks=80, max_num_batched_tokens=32)
        assert _tokens(engine.generate(prompts, GREEDY, use_tqdm=False)) == want
        fast = engine.executor.runner.fast
        assert type(fast).__name__ == "DecodeProgram" and fast.num_runs > 0
        engine.close()


def test_auto_activation_mode_is_rank_zeros_pick():
    """quant_activations="auto" times the kernel modes; under TP every rank runs the mode rank 0 picked (broadcast
    at start), so the tokens are those of one process running that mode."""
    model = make_model("llama")
    prompts = make_prompts(3, [5, 30, 60], seed=2)
    engine = PagedGenerator(model, tensor_parallel_size=2, num_blocks=80, quantization="int4", quant_activations="auto")
    got = _tokens(engine.generate(prompts, GREEDY, use_tqdm=False))
    mode = engine.executor.inner.quantized.activations
    engine.close()
    assert mode in ("float", "int8", "bf16")
    with PagedGenerator(model, num_blocks=80, quantization="int4", quant_activations=mode) as one:
        assert _tokens(one.generate(prompts, GREEDY, use_tqdm=False)) == got


def test_host_kv_tier_under_tensor_parallelism():
    """Every rank demotes and promotes its own KV heads' blocks as rank 0's scheduler says; the prefix comes back
    from the host tier exactly (fp32). The disk tier: tests/test_tensor_parallel_kv_disk.py."""
    model = make_model("llama")
    shared = make_prompts(1, [30], seed=1)[0]
    first, second = shared + [3, 4, 5], shared + [7, 8]
    filler = make_prompts(1, [40], seed=5)[0]
    engine = PagedGenerator(model, tensor_parallel_size=2, num_blocks=12, block_size=4, max_model_len=48,
                            kv_offload_gb=0.001)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        got = [_tokens(engine.generate([p], params, use_tqdm=False))[0] for p in (first, filler, second)]
        tiers = engine.stats().kv_tiers
        engine.kv_manager.check_consistency()
    finally:
        engine.close()
    assert got[2] == stock_greedy(model, second, 6)
    assert tiers["host_hits"] >= 7


def test_an_eagle3_head_drafts_on_rank_0_from_the_hidden_states_it_captures(monkeypatch):
    """Under tensor parallelism rank 0 holds the whole hidden state between layers: its EAGLE-3 head drafts what
    a plain forward of the head drafts. EAGLE-1 heads (the target's sharded lm_head) are refused, clearly."""
    from hf_paged.spec_decode.speculator import Speculator
    from tests.test_eagle import Recorder, random_eagle1, random_head, reference_drafts

    monkeypatch.setattr(Speculator, "num_drafts", lambda self, state, max_len, cost=0.0: min(
        3, state.params.max_tokens - len(state.output_token_ids) - 1))
    model = make_model("llama", num_hidden_layers=4)
    head = random_head(seed=2, draft_vocab=200, aux_layer_ids=[1, 3, 2])
    recorder = Recorder(monkeypatch)
    prompts = make_prompts(3, [9, 20, 33], seed=7)
    engine = PagedGenerator(model, tensor_parallel_size=2, num_blocks=120, block_size=8,
                            speculative_config=dict(method="eagle3", model=head, num_speculative_tokens=3))
    outs = _tokens(engine.generate(prompts, GREEDY, use_tqdm=False))
    with pytest.raises(NotImplementedError, match="EAGLE-1 heads .* run on one process"):
        engine.add_request(prompts[0], GREEDY, speculative_config=dict(method="eagle", model=random_eagle1(),
                                                                        num_speculative_tokens=2))
    again = _tokens(engine.generate(prompts[:1], GREEDY, use_tqdm=False))  # the engine still serves
    engine.close()
    assert outs == [stock_greedy(model, p, NEW) for p in prompts] and again == outs[:1]
    assert len(recorder.calls) > 5
    for tokens, drafts in recorder.calls[:: max(1, len(recorder.calls) // 8)]:
        assert drafts == reference_drafts(model, head, tokens, len(drafts)), len(tokens)
