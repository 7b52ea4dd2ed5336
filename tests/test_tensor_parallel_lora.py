"""Multi-LoRA under tensor parallelism (gloo, 2 processes on loopback): adapters cut like their layers on every
rank, a row-parallel layer's delta counted once; adapter loads reach every rank; greedy ids equal the one-process
LoRA engine's in a mixed batch."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from hf_paged import LoRARequest, PagedGenerator, SamplingParams  # noqa: E402
from hf_paged.lora.manager import LoRAManager  # noqa: E402
from tests.helpers import make_model, make_prompts, stock_greedy  # noqa: E402
from tests.test_lora import ADAPTERS, make_adapter  # noqa: E402
from tests.test_tensor_parallel import no_process_left  # noqa: E402,F401 - autouse: no worker left behind

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
Q, DOWN = "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"


def test_cut_slots_sum_to_the_full_layer(tmp_path):
    """Two ranks simulated in one process: a column-parallel layer's slots (B's rows cut) give the full layer's
    output rows, a row-parallel layer's (A's columns cut) partial outputs sum to the full output with the delta
    once (a whole A on each rank would add it twice)."""
    base = make_model("llama")
    peft_model = make_adapter(base, tmp_path, seed=5, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                              layers_to_transform=[0])
    layers = peft_model.base_model.model.model.layers[0]
    full = {Q: layers.self_attn.q_proj, DOWN: layers.mlp.down_proj}  # PEFT's LoRA layers: base + delta
    x = torch.randn(5, 64)
    h = torch.randn(5, 128)
    cols, sums = [], torch.zeros(5, 64)
    for rank in range(2):
        q_w, down_w = full[Q].base_layer.weight, full[DOWN].base_layer.weight
        q0, q1 = rank * 32, rank * 32 + 32  # q_proj: its output rows (heads) split in two
        d0, d1 = rank * 64, rank * 64 + 64  # down_proj: its input columns split in two
        q = torch.nn.Linear(64, 32, bias=False)
        q.weight.data = q_w[q0:q1].clone()
        down = torch.nn.Linear(64, 64, bias=False)
        down.weight.data = down_w[:, d0:d1].clone()
        manager = LoRAManager({Q: q, DOWN: down}, 1, 8, parts={Q: (0, q0, q1, 64), DOWN: (1, d0, d1, 128)})
        assert manager.targets == {Q: (64, 64), DOWN: (128, 64)}  # checked against the full layers
        manager.add(LoRARequest("a", 1, str(tmp_path)))
        manager.set_step([(1, 5)], torch.device("cpu"))
        with torch.no_grad():
            cols.append(manager.slots[Q](x, q(x)))
            sums += manager.slots[DOWN](h[:, d0:d1], down(h[:, d0:d1]))  # the layer's all-reduce, by hand
        manager.clear_step()
    with torch.no_grad():
        assert torch.allclose(torch.cat(cols, dim=1), full[Q](x), atol=1e-5)
        assert torch.allclose(sums, full[DOWN](h), atol=1e-5)
        assert not torch.allclose(full[DOWN](h), full[DOWN].base_layer(h), atol=1e-3)  # the delta shows


def test_mixed_batch_equals_one_process_and_adapters_reach_every_rank(tmp_path):
    """llama (GQA, q/k/v/o and gate/up/down all adapted between two adapters): base rows and rows of two
    adapters in one batch; an adapter added by add_lora and one loaded by its first request; a bad folder fails
    on every rank and the engine keeps serving; remove_lora removes it everywhere."""
    base = make_model("llama")
    requests, models = {}, {}
    for i, name in enumerate(("a", "b"), start=1):
        models[name] = make_adapter(base, tmp_path / name, seed=40 + i, **ADAPTERS[name])
        requests[name] = LoRARequest(name, i, str(tmp_path / name))
    names = [None, "a", "b", None, "b", "a"]
    prompts = make_prompts(len(names), lengths=[5, 17, 30, 9, 41, 23], seed=6)
    loras = [None if n is None else requests[n] for n in names]
    peft_refs = [stock_greedy(base if n is None else models[n], p, GREEDY.max_tokens) for p, n in zip(prompts, names)]
    with PagedGenerator(base, enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64,
                        max_num_batched_tokens=32) as single:
        want = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]
    assert want == peft_refs  # (the adapters change these rows: test_lora checks that)
    engine = PagedGenerator(base, tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8,
                            num_blocks=64, max_num_batched_tokens=32)
    try:
        assert engine.add_lora(requests["a"]) is True
        assert engine.add_lora(requests["a"]) is False
        outs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)  # "b" loads on every rank here
        assert [o.outputs[0].token_ids for o in outs] == want
        broken = tmp_path / "broken"
        broken.mkdir()
        with pytest.raises(ValueError, match="adapter_config.json"):
            engine.add_lora(LoRARequest("broken", 3, str(broken)))
        assert sorted(r.lora_name for r in engine.list_loras()) == ["a", "b"]
        assert engine.remove_lora(1) is True and engine.remove_lora(1) is False
        assert [r.lora_name for r in engine.list_loras()] == ["b"]
        # id 1 again, now for b's folder: a rank that had kept "a" under id 1 would refuse it
        c = LoRARequest("c", 1, str(tmp_path / "b"))
        again = engine.generate([prompts[4]] * 2, GREEDY, use_tqdm=False, lora_request=[requests["b"], c])
        assert [o.outputs[0].token_ids for o in again] == [want[4]] * 2
        assert sorted(r.lora_name for r in engine.list_loras()) == ["b", "c"]
        engine.kv_manager.check_consistency()
    finally:
        engine.close()
