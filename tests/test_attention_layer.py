"""The engine's attention layer objects (hf_paged/attention/layer.py): built once at engine start, one per
decoder layer, holding the layer's pool tensors, settings and the engine's backend; the backend is never
resolved on a layer call; decode buckets run the engine's backend; engines sharing a model keep their own."""

from __future__ import annotations

import pytest
import torch

from hf_paged import PagedGenerator, SamplingParams, kernels
from hf_paged.attention.layer import Attention, AttentionLayers
from hf_paged.kernels.cpu import attention as cpu_attention
from hf_paged.executor.decode_buckets import DecodeBuckets, resolve_mode
from hf_paged.kernels import graph_ops, torch_attention
from hf_paged.model.layers.linear import DenseLinear
from tests.arch_configs import make_arch_model
from tests.helpers import make_model, make_prompts, stock_greedy

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
needs_native = pytest.mark.skipif(not cpu_attention.available(torch.float32), reason="no native CPU attention here")


def _tokens(engine, prompts, params=GREEDY):
    return [list(o.outputs[0].token_ids) for o in engine.generate(prompts, params, use_tqdm=False)]


def _forbid_resolving(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError(f"resolve_backend{args} called during an engine step")

    monkeypatch.setattr(kernels, "resolve_backend", boom)


@pytest.mark.parametrize("backend,options", [
    ("torch", dict(enforce_eager=True)),
    ("cpu", dict(enforce_eager=True)),
    ("cpu", dict()),  # the native decode program where it fits
    ("torch", dict(decode_runner="static")),
    ("cpu", dict(decode_runner="static")),
])
def test_engine_steps_resolve_no_backend(monkeypatch, backend, options):
    """Prefill chunks, decodes and static buckets: no layer call resolves a backend name (it was resolved once,
    at start), and the tokens are stock generate's."""
    if backend == "cpu" and not cpu_attention.available(torch.float32):
        pytest.skip("no native CPU attention here")
    model = make_model("llama", seed=5)
    prompts = make_prompts(3, lengths=[3, 40, 17], seed=4)
    with PagedGenerator(model, attention_backend=backend, block_size=4, num_blocks=96, max_num_seqs=4,
                        max_num_batched_tokens=24, **options) as engine:
        _forbid_resolving(monkeypatch)
        got = _tokens(engine, prompts)
        layers = engine.executor.runner.attention
        assert layers.backend.name == backend and all(layer.backend is layers.backend for layer in layers)
        fast = engine.executor.runner.fast
        if isinstance(fast, DecodeBuckets):
            assert fast.num_replays > 0
    assert got == [stock_greedy(model, p, 6) for p in prompts]


@needs_native
@pytest.mark.parametrize("backend,native", [("torch", False), ("cpu", True)])
def test_decode_buckets_run_the_engines_attention_backend(monkeypatch, backend, native):
    """Static buckets (the CPU twin of CUDA graphs): the graph op runs the engine's backend. With "torch" the
    native CPU kernel never runs, though it is available here; with "cpu" it does."""
    native_calls, static_calls = [], []
    original_native, original_static = torch_attention.paged_attention_native, graph_ops._static_torch
    monkeypatch.setattr(torch_attention, "paged_attention_native",
                        lambda *a, **k: native_calls.append(1) or original_native(*a, **k))
    monkeypatch.setattr(graph_ops, "_static_torch",
                        lambda *a, **k: static_calls.append(k["native"]) or original_static(*a, **k))
    model = make_model("llama", seed=6)
    prompts = make_prompts(2, lengths=[5, 11], seed=2)
    with PagedGenerator(model, attention_backend=backend, decode_runner="static", enforce_eager=False,
                        num_blocks=64, max_num_seqs=2) as engine:
        buckets = engine.executor.runner.fast
        assert isinstance(buckets, DecodeBuckets) and buckets.attention.backend == backend
        got = _tokens(engine, prompts)
        assert buckets.num_replays > 0
    assert got == [stock_greedy(model, p, 6) for p in prompts]
    assert static_calls and set(static_calls) == {native}
    assert bool(native_calls) == native


@pytest.mark.slow
def test_decode_buckets_with_the_triton_backend_run_triton_on_cpu(monkeypatch):
    """Under the Triton interpreter the static op runs the Triton kernels: it follows the engine's backend, not
    the device (before, any CPU tensor took the torch path)."""
    pytest.importorskip("triton")
    from hf_paged.kernels.triton import attention as triton_attention

    calls = []
    original = triton_attention.paged_attention_triton
    monkeypatch.setattr(triton_attention, "paged_attention_triton", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(graph_ops, "_static_torch", lambda *a, **k: pytest.fail("the torch path ran"))
    model = make_model("llama", seed=6)
    prompt = make_prompts(1, lengths=[5], seed=2)[0]
    with PagedGenerator(model, attention_backend="triton", decode_runner="static", block_size=16, num_blocks=16,
                        max_num_seqs=1, decode_buckets=[1]) as engine:
        got = _tokens(engine, [prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert engine.executor.runner.fast.num_replays == 2
    assert got == [stock_greedy(model, prompt, 3)]
    assert len(calls) == 3 * model.config.num_hidden_layers  # the prefill (eager) and the two bucket replays


def test_cuda_graphs_need_the_triton_backend():
    """CUDA graphs capture the Triton kernels only (the torch path reads the step on the host): "auto" decodes
    eagerly with another backend, an explicit "cuda_graphs" is refused naming it (decided from plain values:
    no CUDA device needed)."""
    cuda = torch.device("cuda")
    assert resolve_mode("auto", False, cuda, "triton") == "cuda_graphs"
    assert resolve_mode("auto", False, cuda, "torch") is None
    assert resolve_mode("static", False, cuda, "torch") == "static"
    with pytest.raises(ValueError, match="attention backend is 'torch'"):
        resolve_mode("cuda_graphs", False, cuda, "torch")


def test_layer_objects_hold_what_each_module_passes():
    """Scaling, window and softcap are read once, from what each layer passes to the attention function
    (gemma2: a softcap, a query_pre_attn_scalar scaling, sliding and full layers)."""
    model = make_arch_model("gemma2")
    with PagedGenerator(model, num_blocks=32) as engine:
        layers = engine.executor.runner.attention
        assert isinstance(layers, AttentionLayers) and len(layers) == model.config.num_hidden_layers
        cfg = model.config
        for module in (m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")):
            layer = layers[module.layer_idx]
            assert isinstance(layer, Attention)
            assert layer.scale == module.scaling == cfg.query_pre_attn_scalar ** -0.5
            assert layer.softcap == cfg.attn_logit_softcapping
            assert layer.sliding_window == module.sliding_window
            assert (layer.k_cache, layer.v_cache) == engine.pool.kv_caches[module.layer_idx]
        assert {layer.sliding_window for layer in layers} == {None, cfg.sliding_window}


def _state(module: torch.nn.Module) -> dict:
    """What a module holds, one level into its dicts (parameters, buffers, submodules), as object identities."""
    return {k: ([(n, id(x)) for n, x in v.items()] if isinstance(v, dict) else id(v)) for k, v in vars(module).items()}


def test_two_engines_on_one_model_keep_their_own_layers_and_closing_one_leaves_the_other_exact():
    model = make_model("mistral", seed=9)
    prompts = make_prompts(3, lengths=[60, 8, 30], seed=5)  # around the window (48)
    want = [stock_greedy(model, p, 6) for p in prompts]
    modules = list(model.modules())
    attention_modules = [m for m in modules if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    before = [_state(m) for m in modules]
    before_attention = [_state(m) for m in attention_modules]
    a = PagedGenerator(model, attention_backend="torch", num_blocks=64, enforce_eager=True)
    b = PagedGenerator(model, num_blocks=48, block_size=8)
    try:
        la, lb = a.executor.runner.attention, b.executor.runner.attention
        assert la is not lb and la.backend is not lb.backend and la.backend.name == "torch"
        for i in range(len(la)):
            assert la[i] is not lb[i]
            assert la[i].k_cache is a.pool.kv_caches[i][0] and lb[i].v_cache is b.pool.kv_caches[i][1]
        assert _tokens(a, prompts) == want and _tokens(b, prompts) == want
        # the attention objects are the engines', not on the modules (their children are the engines' linear
        # layer objects while an engine holds the model: model/layers/linear.py)
        assert [{k: v for k, v in _state(m).items() if k != "_modules"} for m in attention_modules] == [
            {k: v for k, v in state.items() if k != "_modules"} for state in before_attention]
        assert all(type(child) is DenseLinear for m in attention_modules for child in m._modules.values())
        a.close()
        assert len(la) == 0  # its layer objects let its pool go
        assert _tokens(b, prompts) == want
    finally:
        a.close()
        b.close()
    assert model.config._attn_implementation == "sdpa"
    assert [_state(m) for m in modules] == before
    assert [stock_greedy(model, p, 6) for p in prompts] == want
