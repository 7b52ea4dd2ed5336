"""LoRA adapters at load: PEFT's scaling, clear errors for bad folders (the engine keeps serving), the host LRU,
the engine's settings, and the scheduler's cap on distinct adapters per step (pure Python)."""

from __future__ import annotations

import json
import math

import pytest
import torch

peft = pytest.importorskip("peft")

from hf_paged import EngineConfig, LoRARequest, PagedGenerator, SamplingParams  # noqa: E402
from hf_paged.core.kv_cache_manager import KVCacheManager  # noqa: E402
from hf_paged.core.scheduler import Scheduler  # noqa: E402
from hf_paged.core.sequence import Sequence  # noqa: E402
from hf_paged.lora.loading import load_lora  # noqa: E402
from tests.helpers import make_model, make_prompts, stock_greedy  # noqa: E402
from tests.test_lora import make_adapter  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def base():
    return make_model("llama")


@pytest.fixture(scope="module")
def good(base, tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    model = make_adapter(base, folder, seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return LoRARequest("good", 1, str(folder)), model


def targets(model):
    """The base's decoder-layer linears as load_lora takes them (outside an engine: the stock nn.Linear)."""
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in name}


def test_scaling_follows_peft(base, tmp_path):
    model = make_adapter(base, tmp_path, seed=2, r=8, lora_alpha=16, use_rslora=True,
                         target_modules=["q_proj", "o_proj"], rank_pattern={"o_proj": 2}, alpha_pattern={"q_proj": 4})
    loaded = load_lora(LoRARequest("x", 1, str(tmp_path)), targets(base), 8)
    layers = model.base_model.model.model.layers
    for name, peft_layer in [("model.layers.0.self_attn.q_proj", layers[0].self_attn.q_proj),
                             ("model.layers.1.self_attn.o_proj", layers[1].self_attn.o_proj)]:
        assert loaded.layers[name].rank == peft_layer.r["default"]
        assert loaded.layers[name].scale == pytest.approx(peft_layer.scaling["default"])
    # rsLoRA with per-module patterns: alpha 4 over sqrt(8) for q_proj, alpha 16 over sqrt(2) for o_proj
    assert loaded.layers["model.layers.0.self_attn.q_proj"].scale == pytest.approx(4 / math.sqrt(8))
    assert loaded.layers["model.layers.1.self_attn.o_proj"].scale == pytest.approx(16 / math.sqrt(2))


def _break(folder, how):
    config = folder / "adapter_config.json"
    weights = folder / "adapter_model.safetensors"
    if how == "no config":
        config.unlink()
    elif how == "bad json":
        config.write_text("{not json")
    elif how == "garbage weights":
        weights.write_bytes(b"\x00garbage" * 10)
    elif how in ("lm_head target", "embed_tokens target"):
        data = json.loads(config.read_text())
        data["target_modules"] = ["q_proj", how.split()[0]]
        config.write_text(json.dumps(data))
    else:  # the weights file's keys changed
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(weights))
        key = next(k for k in sorted(tensors) if "lora_B" in k)
        tensor = tensors.pop(key)
        if how == "absent module":  # a module the base model lacks
            a_key = key.replace("lora_B", "lora_A")
            for k, t in ((key, tensor), (a_key, tensors.pop(a_key))):
                tensors[k.replace("q_proj", "x_proj")] = t
        elif how == "embedding weights":
            tensors[key.replace("q_proj.lora_B", "embed_tokens.lora_embedding_B")] = tensor
        save_file(tensors, str(weights))  # "missing lora_B": the popped key left out


@pytest.mark.parametrize("how, words", [
    ("no config", ["adapter_config.json", "not found"]),
    ("bad json", ["adapter_config.json", "unreadable"]),
    ("garbage weights", ["adapter_model.safetensors", "unreadable"]),
    ("lm_head target", ["adapter_config.json", "lm_head"]),
    ("embed_tokens target", ["adapter_config.json", "embed_tokens", "not supported"]),
    ("embedding weights", ["adapter_model.safetensors", "embedding adapters", "not supported"]),
    ("absent module", ["adapter_model.safetensors", "x_proj", "target module not present"]),
    ("missing lora_B", ["adapter_model.safetensors", "q_proj has no lora_B"]),
])
def test_broken_folder_is_a_clear_error_and_the_engine_keeps_serving(base, good, tmp_path, how, words):
    make_adapter(base, tmp_path, seed=3, r=4, target_modules=["q_proj"])
    _break(tmp_path, how)
    prompt = make_prompts(1, seed=4)[0]
    with PagedGenerator(base, enable_lora=True, max_lora_rank=8, num_blocks=32) as engine:
        with pytest.raises(ValueError) as err:
            engine.generate([prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 2, str(tmp_path)))
        assert all(w in str(err.value) for w in words), str(err.value)
        assert [r.lora_name for r in engine.list_loras()] == []
        out = engine.generate([prompt], GREEDY, use_tqdm=False, lora_request=good[0])
    assert out[0].outputs[0].token_ids == stock_greedy(good[1], prompt, 6)


def test_mismatched_shapes_and_rank_name_the_file_and_module(base, tmp_path):
    wider = make_model("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    make_adapter(wider, tmp_path / "wide", seed=5, r=4, target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors.*q_proj.*in_features=64"):
        load_lora(LoRARequest("w", 1, str(tmp_path / "wide")), targets(base), 8)
    make_adapter(base, tmp_path / "big", seed=6, r=16, target_modules=["v_proj"])
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors.*rank 16.*max_lora_rank=8"):
        load_lora(LoRARequest("b", 1, str(tmp_path / "big")), targets(base), 8)
    with pytest.raises(ValueError, match="is not a folder"):
        load_lora(LoRARequest("m", 1, str(tmp_path / "missing")), targets(base), 8)


def test_host_lru_reads_an_evicted_adapter_again(base, good, tmp_path):
    other = make_adapter(base, tmp_path, seed=7, r=2, target_modules=["down_proj"])
    second = LoRARequest("other", 2, str(tmp_path))
    prompts = make_prompts(4, seed=8)
    with PagedGenerator(base, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8, num_blocks=32) as engine:
        manager = engine.executor.lora
        for prompt, req, model in zip(prompts, [good[0], second, good[0], second], [good[1], other, good[1], other]):
            out = engine.generate([prompt], GREEDY, use_tqdm=False, lora_request=req)
            assert out[0].outputs[0].token_ids == stock_greedy(model, prompt, 6)
            assert list(manager._host) == [req.lora_int_id]  # one adapter in host memory at a time


def test_add_remove_list(base, good):
    with PagedGenerator(base, enable_lora=True, max_lora_rank=8, num_blocks=32) as engine:
        assert engine.add_lora(good[0]) is True and engine.add_lora(good[0]) is False
        with pytest.raises(ValueError, match="already the adapter 'good'"):
            engine.add_lora(LoRARequest("other", 1, good[0].lora_path))
        rid = engine.add_request(make_prompts(1)[0], GREEDY, lora_request=good[0])
        with pytest.raises(ValueError, match="in use by 1"):
            engine.remove_lora(1)
        engine.abort(rid)
        assert engine.remove_lora(1) is True and engine.remove_lora(1) is False
        assert engine.list_loras() == []


def test_settings_are_checked(base, good):
    with pytest.raises(ValueError, match="max_cpu_loras=1 must be >= max_loras=2"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank must be >= 1"):
        EngineConfig(enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="decode_runner='inductor' conflicts with enable_lora"):
        EngineConfig(enable_lora=True, decode_runner="inductor")
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("x", 0, "/tmp")
    with PagedGenerator(base, num_blocks=32) as engine:
        with pytest.raises(ValueError, match="enable_lora=True"):
            engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=good[0])


def _seq(rid: str, lora: int) -> Sequence:
    return Sequence(rid, [1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0.0), lora_int_id=lora)


def test_scheduler_admits_at_most_max_loras_distinct_adapters():
    sched = Scheduler(KVCacheManager(32, 4, enable_prefix_caching=False), 8, 64, 64, max_loras=2)
    for rid, lora in [("a", 1), ("b", 2), ("c", 3), ("base", 0), ("a2", 1)]:
        sched.add_request(_seq(rid, lora))
    out = sched.schedule()
    # adapter 3 waits; base and a second request of adapter 1 go past it
    assert sorted(sched.sequences[s.seq_id].request_id for s in out.scheduled) == ["a", "a2", "b", "base"]
    assert {s.lora_int_id for s in out.scheduled} == {0, 1, 2}
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_adapter_is_part_of_the_prefix_hash():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    a, b = _seq("a", 1), _seq("b", 2)
    a.prompt_token_ids = b.prompt_token_ids = list(range(1, 10))
    kv.allocate_slots("a", 0, 9)
    kv.cache_blocks("a", a, 8)
    assert len(kv.find_cached_prefix(a)[0]) == 2
    assert kv.find_cached_prefix(b)[0] == [] and kv.find_cached_prefix(list(range(1, 10)))[0] == []


@pytest.mark.parametrize("token_slots,layout", [
    ([-1, -1, 0, 0, 0, 2, 2, -1], "padded"),  # short runs: gathered, padded by slot, one bmm pair
    ([-1] + [0] * 20 + [2] * 18 + [-1], "runs"),  # a few long runs: computed in place on views
    ([0, 1, 2, -1, 2, 1, 0, 0, 1, -1, 2, 0, 1, 2, 0, 1, 1, 0, 2, 0], "padded"),
    ([0] * 3 + [1, 0, 2, 0] + [0] * 55, "segments"),  # uneven: padding would cost more than the rows
])
def test_slot_adds_each_rows_adapter_delta(token_slots, layout):
    from hf_paged.lora.loading import LoRALayerWeights
    from hf_paged.lora.slots import LoRASlot, plan_step

    class Source:
        plan = None

    torch.manual_seed(0)
    source = Source()
    slot = LoRASlot(source, 12, 10, max_loras=3, max_rank=4, device=torch.device("cpu"), dtype=torch.float32)
    weights = {0: LoRALayerWeights(torch.randn(4, 12), torch.randn(10, 4), 0.5),
               2: LoRALayerWeights(torch.randn(2, 12), torch.randn(10, 2), 3.0)}
    for index, w in weights.items():
        slot.set(index, w)
    slot.set(1, None)  # the adapter in slot 1 leaves this layer alone
    x, y = torch.randn(1, len(token_slots), 12), torch.randn(1, len(token_slots), 10)
    expected = y.clone()
    for row, index in enumerate(token_slots):
        if index in weights:
            w = weights[index]
            expected[0, row] += (x[0, row] @ w.a.t() @ w.b.t()) * w.scale
    source.plan = plan_step(token_slots, torch.device("cpu"))
    assert source.plan.layout == layout
    assert torch.allclose(slot(x, y.clone()), expected, atol=1e-5)
    source.plan = None
    assert torch.equal(slot(x, y), y)  # no plan: nothing added
