"""Multi-LoRA: a mixed batch of base rows and rows of PEFT adapters equals PEFT's own generate per adapter.

Adapters are made with peft (``init_lora_weights=False``: random non-zero A and B) on the tiny seeded models and
saved into a temporary folder; the reference for a row is the unmerged ``PeftModel``'s greedy ``generate``.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch

peft = pytest.importorskip("peft")

from hf_paged import LoRARequest, PagedGenerator, SamplingParams  # noqa: E402
from tests.helpers import make_model, make_prompts, stock_greedy  # noqa: E402

MAX_TOKENS = 10
# two adapters of different ranks and targets; B uses rsLoRA and a per-module rank and alpha
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "b": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"],
              rank_pattern={"o_proj": 2}, alpha_pattern={"up_proj": 4}),
    "c": dict(r=2, lora_alpha=32, target_modules=["q_proj", "o_proj"]),
}


def make_adapter(base, folder, seed: int, **config):
    """A PEFT adapter with random A and B on a copy of ``base``, saved in ``folder``; returns the PeftModel."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **config)).eval()
    model.save_pretrained(str(folder))
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def setup(request, tmp_path_factory):
    """(base model, {name: (LoRARequest, PeftModel)}) for one architecture."""
    base = make_model(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = {}
    for i, (name, config) in enumerate(ADAPTERS.items(), start=1):
        peft_model = make_adapter(base, root / name, seed=10 + i, **config)
        adapters[name] = (LoRARequest(name, i, str(root / name)), peft_model)
    return base, adapters


def reference(base, adapters, prompt, name):
    return stock_greedy(base if name is None else adapters[name][1], prompt, MAX_TOKENS)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def test_mixed_batch_equals_peft(setup):
    base, adapters = setup
    names = [None, "a", "b", None, "b", "a"]
    prompts = make_prompts(len(names), seed=3)
    refs = [reference(base, adapters, p, n) for p, n in zip(prompts, names)]
    # the adapters change the output, so a slot that applied nothing would fail here
    assert any(stock_greedy(base, p, MAX_TOKENS) != r for p, r, n in zip(prompts, refs, names) if n)
    with PagedGenerator(base, enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64) as engine:
        outs = engine.generate(prompts, GREEDY, use_tqdm=False,
                               lora_request=[None if n is None else adapters[n][0] for n in names])
        assert sorted(r.lora_name for r in engine.list_loras()) == ["a", "b"]
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_mixed_batch_equals_merge_and_unload(setup):
    """Each row equals PEFT's merged model (``merge_and_unload``: W + scale * B A folded into the weight) for its
    adapter. The engine adds the delta unmerged, so its logits differ from the merged model's by float rounding:
    measured up to 2e-5 on logits of about 5 (fp32) at the greedy positions of this test, whose closest top-1/top-2
    gap is 2.2e-3 (100x more), so the ids must be equal; a wrong scale, a missed module or a row given another row's adapter changes
    them (the adapters' rows differ from the base's and from each other's, checked below). Other seeds may bring a
    near-tie closer than the rounding: then a mismatch is no bug, and the seed should move."""
    base, adapters = setup
    merged = {name: copy.deepcopy(model).merge_and_unload() for name, (_, model) in adapters.items()}
    assert not any("lora" in name for name, _ in merged["a"].named_modules())  # really merged: plain linears
    names = [None, "a", "b", "c", None, "c", "b", "a"]
    prompts = make_prompts(len(names), seed=4)
    refs = [stock_greedy(base if n is None else merged[n], p, MAX_TOKENS) for p, n in zip(prompts, names)]
    for name in ADAPTERS:  # every adapter changes its rows' tokens, and differently from the other adapters
        rows = [i for i, n in enumerate(names) if n == name]
        assert any(refs[i] != stock_greedy(base, prompts[i], MAX_TOKENS) for i in rows), name
        others = [m for m in ADAPTERS if m != name]
        assert all(any(refs[i] != stock_greedy(merged[m], prompts[i], MAX_TOKENS) for i in rows) for m in others)
    with PagedGenerator(base, enable_lora=True, max_loras=3, max_lora_rank=8, num_blocks=64) as engine:
        outs = engine.generate(prompts, GREEDY, use_tqdm=False,
                               lora_request=[None if n is None else adapters[n][0] for n in names])
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_more_adapters_than_max_loras_queue(setup):
    """Three adapters with max_loras=1: they take turns, every request finishes with its adapter's tokens."""
    base, adapters = setup
    names = ["a", "b", "c", None, "c", "a"]
    prompts = make_prompts(len(names), seed=5)
    refs = [reference(base, adapters, p, n) for p, n in zip(prompts, names)]
    with PagedGenerator(base, enable_lora=True, max_loras=1, max_lora_rank=8, num_blocks=64,
                        max_cpu_loras=2) as engine:
        seen = []
        original = engine.scheduler.schedule

        def schedule():
            out = original()
            seen.append({s.lora_int_id for s in out.scheduled if s.lora_int_id})
            return out

        engine.scheduler.schedule = schedule
        outs = engine.generate(prompts, GREEDY, use_tqdm=False,
                               lora_request=[None if n is None else adapters[n][0] for n in names])
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert max(len(s) for s in seen) == 1 and len(set().union(*seen)) == 3


def test_prefix_cache_isolated_per_adapter(setup):
    """A prompt cached under adapter A is never served to B or base; under A again it is."""
    base, adapters = setup
    prompt = make_prompts(1, lengths=[40], seed=9)[0]
    with PagedGenerator(base, enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64, block_size=8) as engine:
        hits = []
        for name in ("a", "b", None, "a"):
            before = engine.stats().prefix_cache_hits
            out = engine.generate([prompt], GREEDY, use_tqdm=False,
                                  lora_request=None if name is None else adapters[name][0])
            hits.append(engine.stats().prefix_cache_hits - before)
            assert out[0].outputs[0].token_ids == reference(base, adapters, prompt, name), name
    assert hits[:3] == [0, 0, 0] and hits[3] > 0


def test_n_samples_and_ngram_drafts_keep_the_adapter(setup):
    base, adapters = setup
    req = adapters["b"][0]
    prompts = make_prompts(2, lengths=[20, 30], seed=11)
    refs = [reference(base, adapters, p, "b") for p in prompts]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    with PagedGenerator(base, enable_lora=True, max_lora_rank=8, num_blocks=64, speculative_config=spec) as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=2),
                               use_tqdm=False, lora_request=req)
    for out, ref in zip(outs, refs):
        assert [c.token_ids for c in out.outputs] == [ref, ref]


def test_preempted_adapter_rows_resume_with_their_adapter(setup):
    base, adapters = setup
    names = ["a", "b", None, "a"]
    prompts = make_prompts(len(names), lengths=[24, 24, 24, 24], seed=13)
    refs = [reference(base, adapters, p, n) for p, n in zip(prompts, names)]
    with PagedGenerator(base, enable_lora=True, max_lora_rank=8, num_blocks=13, block_size=8,
                        enable_prefix_caching=False) as engine:
        outs = engine.generate(prompts, GREEDY, use_tqdm=False,
                               lora_request=[None if n is None else adapters[n][0] for n in names])
        assert sum(engine.stats().num_preemptions.values()) > 0
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_static_buckets_run_adapter_steps(setup):
    """The "static" decode buckets run steps with adapter rows too (the padding rows are base rows for the
    slots): greedy ids equal PEFT's, and the buckets served adapter steps."""
    base, adapters = setup
    names = [None, "a", "b", "b", "a"]  # 5 sequences: padded to a bucket of 8
    prompts = make_prompts(len(names), seed=31)
    refs = [reference(base, adapters, p, n) for p, n in zip(prompts, names)]
    with PagedGenerator(base, enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64,
                        decode_runner="static") as engine:
        buckets = engine.executor.runner.fast
        outs = engine.generate(prompts, GREEDY, use_tqdm=False,
                               lora_request=[None if n is None else adapters[n][0] for n in names])
        assert buckets.num_lora_replays >= MAX_TOKENS - 2
        assert all(layer.lora is None for layer in engine.executor.lora._layers.values())
    assert [o.outputs[0].token_ids for o in outs] == refs


@pytest.mark.parametrize("names", [
    [None, "a", "b", None, "b", "a", "a", "b"],  # decodes of interleaved adapters: the padded bmm layout
    ["a", "a", "a", "b", "b", None],  # few runs
    ["b"],  # batch 1: one run
])
def test_native_program_runs_adapter_steps(setup, names):
    """Steps with adapter rows run on the native decode program (its LoRA delta ops): greedy ids equal the eager
    engine's and PEFT's, and the program served adapter steps (it does not step aside)."""
    base, adapters = setup
    prompts = make_prompts(len(names), seed=29)
    refs = [reference(base, adapters, p, n) for p, n in zip(prompts, names)]
    loras = [None if n is None else adapters[n][0] for n in names]
    settings = dict(enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64)
    try:
        engine = PagedGenerator(base, decode_runner="native", prepack_weights="native", **settings)
    except ValueError as e:  # the native program needs kernels this CPU may lack
        pytest.skip(str(e))
    with engine:
        program = engine.executor.runner.fast
        outs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert program.num_lora_runs >= MAX_TOKENS - 2, program.why_not
        assert all(layer.lora is None for layer in engine.executor.lora._layers.values())
        base_runs = program.num_runs - program.num_lora_runs
        engine.generate([prompts[0]], GREEDY, use_tqdm=False)  # base only: the base call list
        assert program.num_runs - program.num_lora_runs > base_runs
    with PagedGenerator(base, enforce_eager=True, **settings) as eager:
        eager_outs = eager.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    native = [o.outputs[0].token_ids for o in outs]
    assert native == [o.outputs[0].token_ids for o in eager_outs]
    assert native == refs


def test_swap_preemption_and_quantized_base_with_adapters(tmp_path):
    """Swapped-out adapter rows come back with their adapter; on an int8 base the adapter rows equal PEFT's on the
    same quantized layers."""
    base = make_model("llama")
    peft_model = make_adapter(base, tmp_path, seed=23, **ADAPTERS["a"])
    req = LoRARequest("a", 1, str(tmp_path))
    names = ["a", None, "a", "a"]
    prompts = make_prompts(len(names), lengths=[24, 24, 24, 24], seed=19)
    refs = [stock_greedy(peft_model if n else base, p, MAX_TOKENS) for p, n in zip(prompts, names)]
    loras = [req if n else None for n in names]
    with PagedGenerator(base, enable_lora=True, max_lora_rank=8, num_blocks=13, block_size=8,
                        enable_prefix_caching=False, preemption_mode="swap", swap_space=1 << 22) as engine:
        outs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert engine.stats().num_preemptions["swap"] > 0
    assert [o.outputs[0].token_ids for o in outs] == refs

    # an int8 base: the reference is PEFT's model with every linear (its LoRA layers' base layers and the LM head
    # too) replaced by the QuantLinear the engine makes from the same float weights, float activations
    from hf_paged.model.layers.quant_linear import QuantLinear
    from hf_paged.model.layers.quantize import QuantizedLinears

    quantized = copy.deepcopy(base)
    QuantizedLinears(quantized, "int8", "float")
    quant_peft = copy.deepcopy(peft_model)
    inner = quant_peft.base_model.model
    for name, module in quantized.named_modules():
        if isinstance(module, QuantLinear):
            parent, _, leaf = name.rpartition(".")
            target = inner.get_submodule(name)
            if hasattr(target, "base_layer"):  # a PEFT LoRA layer: its base layer becomes the quantized one
                target.base_layer = module
            else:
                setattr(inner.get_submodule(parent) if parent else inner, leaf, module)
    with PagedGenerator(base, enable_lora=True, max_lora_rank=8, num_blocks=64, quantization="int8",
                        quant_activations="float") as engine:
        quant_base, quant_lora = (engine.generate(prompts[:2], GREEDY, use_tqdm=False, lora_request=[r, r])
                                  for r in (None, req))
    for outs, model in ((quant_lora, quant_peft), (quant_base, quantized)):
        assert [o.outputs[0].token_ids for o in outs] == [stock_greedy(model, p, MAX_TOKENS) for p in prompts[:2]]
    assert quant_lora[0].outputs[0].token_ids != quant_base[0].outputs[0].token_ids


def test_another_engine_on_the_model_never_gets_an_adapter_steps_deltas(tmp_path):
    """Engines on one model share its linear layer objects: while a LoRA engine's step has its slots on them, a
    plain engine's forward in another thread (same token count) runs the base model, not that step's adapter."""
    import threading

    base = make_model("llama")
    make_adapter(base, tmp_path, seed=25, **ADAPTERS["a"])
    req = LoRARequest("a", 1, str(tmp_path))
    prompt = make_prompts(1, lengths=[12], seed=23)[0]
    with PagedGenerator(base, enable_lora=True, max_lora_rank=8, num_blocks=32) as lora_engine, \
            PagedGenerator(base, num_blocks=32) as plain:
        lora_engine.add_lora(req)
        manager = lora_engine.executor.lora
        outs = []
        manager.set_step([(1, len(prompt))], torch.device("cpu"))  # the LoRA engine mid-step, in this thread
        try:
            assert any(layer.lora is not None for layer in manager._layers.values())
            other = threading.Thread(target=lambda: outs.extend(plain.generate([prompt], GREEDY, use_tqdm=False)))
            other.start()
            other.join(120)
        finally:
            manager.clear_step()
        assert outs[0].outputs[0].token_ids == stock_greedy(base, prompt, MAX_TOKENS)
