"""Decode buckets with LoRA adapter rows: the static index buffer filled before each replay, one forward per
(bucket, query length, generation) whatever the adapter mix. On CPU the "static" mode replays eagerly (the
CPU-testable twin of the CUDA graphs); the capture itself runs only on CUDA (``gpu``)."""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

from hf_paged import LoRARequest, PagedGenerator, SamplingParams  # noqa: E402
from hf_paged.lora.slots import plan_step  # noqa: E402
from tests.helpers import make_model, make_prompts, stock_greedy  # noqa: E402

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
ADAPTERS = {  # different ranks and targets: "b" adapts linears "a" leaves alone
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "b": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
}
SETTINGS = dict(enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = make_model("llama")
    root = tmp_path_factory.mktemp("lora-buckets")
    adapters = {}
    for i, (name, config) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(40 + i)
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **config)).eval()
        model.save_pretrained(str(root / name))
        adapters[name] = (LoRARequest(name, i, str(root / name)), model)
    return base, adapters


def requests(adapters, names):
    return [None if n is None else adapters[n][0] for n in names]


def eager_ids(base, adapters, prompts, names, **extra):
    with PagedGenerator(base, enforce_eager=True, **SETTINGS, **extra) as engine:
        outs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests(adapters, names))
    return [o.outputs[0].token_ids for o in outs]


def test_static_replay_fills_the_index_and_equals_eager(setup):
    """Mixed adapter and base rows padded to a bucket: every decode step replays a bucket forward, whose slot
    index holds each row's slot and -1 on padding, and the greedy ids equal a plain eager engine's (and PEFT's)."""
    base, adapters = setup
    names = ["a", None, "b", "a", "b"]  # 5 sequences: a bucket of 8, three padding rows
    prompts = make_prompts(len(names), seed=7)
    want = eager_ids(base, adapters, prompts, names)
    assert want == [stock_greedy(base if n is None else adapters[n][1], p, MAX_TOKENS) for p, n in zip(prompts, names)]
    with PagedGenerator(base, decode_runner="static", **SETTINGS) as engine:
        buckets = engine.executor.runner.fast
        manager = engine.executor.lora
        seen = []
        original = buckets._replay

        def replay(scheduled, key):
            plan = manager.plan
            if plan is not None:  # an adapter step: the static plan over the bucket's buffer
                assert plan.static and plan.token_index.data_ptr() == buckets.lora_index.data_ptr()
                seen.append((len(scheduled), key, plan.token_index.tolist(), list(plan.token_slots)))
            return original(scheduled, key)

        buckets._replay = replay
        outs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests(adapters, names))
        assert all(layer.lora is None for layer in manager._layers.values())  # every slot came off again
        assert manager.plan is None
    assert [o.outputs[0].token_ids for o in outs] == want
    assert len(seen) >= MAX_TOKENS - 2 and buckets.num_lora_replays == len(seen)
    for n, key, index, token_slots in seen:
        bucket, q = key[0], key[1]
        assert len(key) == 3 and key[2] == manager.generation
        assert len(index) == bucket * q and index[: n * q] == token_slots and index[n * q :] == [-1] * (bucket - n) * q
    # one forward per (bucket, q, generation): built once, replayed every step
    assert sum(len(k) == 3 for k in buckets.graphs) == len({s[1] for s in seen})


def test_a_new_linear_with_adapter_tensors_rebuilds_the_forward(setup):
    """A forward made while only "a"'s linears had adapter tensors is dropped when "b" brings others (a captured
    graph would lack their kernels); the rows of both adapters are then right."""
    base, adapters = setup
    prompts = make_prompts(4, seed=8)
    with PagedGenerator(base, decode_runner="static", **SETTINGS) as engine:
        buckets, manager = engine.executor.runner.fast, engine.executor.lora
        first = engine.generate(prompts[:2], GREEDY, use_tqdm=False, lora_request=requests(adapters, ["a", "a"]))
        gen_a = manager.generation
        assert {k[2] for k in buckets.graphs if len(k) == 3} == {gen_a}
        second = engine.generate(prompts[2:], GREEDY, use_tqdm=False, lora_request=requests(adapters, ["b", "a"]))
        assert manager.generation > gen_a
        assert {k[2] for k in buckets.graphs if len(k) == 3} == {manager.generation}
    got = [o.outputs[0].token_ids for o in first + second]
    assert got == [stock_greedy(adapters[n][1], p, MAX_TOKENS) for p, n in zip(prompts, ["a", "a", "b", "a"])]


def test_a_bucket_that_cannot_be_built_leaves_the_step_to_eager_with_its_adapters(setup, monkeypatch):
    """When the bucket forward fails to build, the eager path serves the step with the step's own plan and slots
    (the static plan is undone), so adapter rows keep their deltas."""
    base, adapters = setup
    names = ["b", None, "a"]
    prompts = make_prompts(len(names), seed=9)
    with PagedGenerator(base, decode_runner="static", **SETTINGS) as engine:
        buckets = engine.executor.runner.fast

        def fail(bucket, q):
            raise RuntimeError("no bucket today")

        monkeypatch.setattr(buckets, "_build", fail)
        outs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests(adapters, names))
        assert buckets.disabled_reason is not None and buckets.num_lora_replays == 0
    refs = [stock_greedy(base if n is None else adapters[n][1], p, MAX_TOKENS) for p, n in zip(prompts, names)]
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_cuda_plans_are_per_token():
    """On CUDA (or when asked) a step's plan is the per-token index the kernels read; on CPU the grouped layouts."""
    slots = [1, -1, 0, 0, 1]
    cpu = plan_step(slots, torch.device("cpu"))
    assert cpu.layout != "tokens" and cpu.token_slots == slots
    tokens = plan_step(slots, torch.device("cpu"), per_token=True)
    assert tokens.layout == "tokens" and tokens.token_index.dtype == torch.int32
    assert tokens.token_index.tolist() == slots and tokens.segments == [(1, 0, 1), (0, 2, 4), (1, 4, 5)]


@pytest.mark.gpu
def test_cuda_graphs_capture_adapter_steps(setup):
    """On CUDA the decode buckets capture adapter steps into CUDA graphs (the Triton shrink/expand over the static
    index) and replay them for other mixes; greedy ids equal the eager CUDA engine's and PEFT's."""
    base, adapters = setup
    cuda = copy.deepcopy(base).to("cuda")
    names = ["a", None, "b", "a", "b"]
    prompts = make_prompts(len(names), seed=7)
    refs = [stock_greedy(base if n is None else adapters[n][1], p, MAX_TOKENS) for p, n in zip(prompts, names)]
    want = eager_ids(cuda, adapters, prompts, names)
    with PagedGenerator(cuda, decode_runner="cuda_graphs", **SETTINGS) as engine:
        buckets = engine.executor.runner.fast
        outs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests(adapters, names))
        again = engine.generate(prompts[::-1], GREEDY, use_tqdm=False, lora_request=requests(adapters, names[::-1]))
        assert buckets.disabled_reason is None, buckets.disabled_reason
        assert buckets.num_lora_replays >= 2 * (MAX_TOKENS - 2)
        assert any(len(k) == 3 for k in buckets.graphs)
    assert [o.outputs[0].token_ids for o in outs] == want == refs
    assert [o.outputs[0].token_ids for o in again] == want[::-1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_delta_on_cuda(dtype):
    """The compiled kernels (bf16 included, which the interpreter cannot check) against a float64 loop."""
    from hf_paged.kernels.lora import add_lora_delta

    g = torch.Generator().manual_seed(0)
    slots, rank, in_f, out_f = 4, 16, 320, 200
    ranks = [16, 4, 0, 9]
    a = torch.zeros(slots, rank, in_f)
    b = torch.zeros(slots, out_f, rank)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, in_f, generator=g) / in_f**0.5
        b[s, :, :r] = torch.randn(out_f, r, generator=g)
    scales = torch.tensor([0.5, 2.0, 1.0, -1.0])
    index = torch.tensor([3, -1, 0, 1, 1, -1, 3, 0, 2], dtype=torch.int32)
    x = torch.randn(index.numel(), in_f, generator=g)
    wide = torch.randn(index.numel(), out_f + 8, generator=g)
    want = wide.to(dtype)[:, 8:].double()  # y as the kernel gets it
    a_q, b_q, x_q = (t.to(dtype).double() for t in (a, b, x))  # the inputs as the kernel sees them
    for t, s in enumerate(index.tolist()):
        if s >= 0:
            want[t] += scales[s].double() * (x_q[t] @ a_q[s].t()) @ b_q[s].t()
    y_full = wide.to(dtype).cuda()
    y = y_full[:, 8:]
    add_lora_delta(x.to(dtype).cuda(), a.to(dtype).cuda(), b.to(dtype).cuda(), scales.cuda(), index.cuda(), y)
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}[dtype]
    torch.testing.assert_close(y.double().cpu(), want, rtol=tol, atol=tol)


def test_engine_runs_the_triton_kernels_under_the_interpreter(setup):
    """The CUDA code path on CPU: eager steps with per-token plans and decode-bucket replays, both running the
    Triton shrink/expand (TRITON_INTERPRET=1): greedy ids equal PEFT's. Short, as each launch costs ~0.1 s."""
    pytest.importorskip("triton")
    base, adapters = setup
    names = ["a", None]  # "a" alone: fewer linears with adapter tensors, fewer launches
    prompts = make_prompts(len(names), lengths=[3, 4], seed=11)
    refs = [stock_greedy(base if n is None else adapters[n][1], p, 2) for p, n in zip(prompts, names)]
    with PagedGenerator(base, decode_runner="static", **SETTINGS) as engine:
        manager = engine.executor.lora
        manager.per_token, manager.kernel_backend = True, "triton"
        calls = []
        import hf_paged.kernels.triton.lora as kernels

        original = kernels.lora_shrink_triton

        def counted(*args):
            calls.append(manager.plan.static)
            return original(*args)

        kernels.lora_shrink_triton = counted
        try:
            outs = engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False,
                                   lora_request=requests(adapters, names))
        finally:
            kernels.lora_shrink_triton = original
        assert engine.executor.runner.fast.num_lora_replays >= 1
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert True in calls and False in calls  # bucket replays and eager (prefill) steps both ran the kernels
