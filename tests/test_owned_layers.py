"""The engine's linear layer objects (model/layers/linear.py): made once at engine start in place of every plain
``nn.Linear`` (sharing its parameters), given back exactly by the last ``close()``, and each with a LoRA slot
that every way of running the layer honours (eager, the fused CPU layers' packed groups, quantized kernels; the
native decode program steps aside while a slot is set)."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.model.layers.quant_linear import QuantLinear
from hf_paged.model.layers.linear import DenseLinear, engine_linears
from tests.helpers import make_model, make_prompts, stock_greedy

MAX_TOKENS = 8
TARGETS = ("q_proj", "v_proj", "gate_proj", "down_proj")


def _linears(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_engine_owns_every_linear_and_gives_the_stock_modules_back():
    model = copy.deepcopy(make_model("llama"))
    before = _linears(model)
    keys = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    engine = PagedGenerator(model, num_blocks=32, block_size=4)
    try:
        owned = dict(engine_linears(model))
        assert set(owned) == set(before) and all(type(m) is DenseLinear for m in owned.values())
        for name, layer in owned.items():  # the very parameters (tied weights, optimizers, state_dict keys)
            assert layer.weight is before[name].weight and layer.bias is before[name].bias
        after = model.state_dict(keep_vars=True)
        assert list(after) == list(keys) and all(after[k] is keys[k] for k in keys)
        # a second engine shares the layer objects (one owner per model, reference-counted)
        second = PagedGenerator(model, num_blocks=32, block_size=4)
        assert dict(engine_linears(model)) == owned
        second.close()
        assert dict(engine_linears(model)) == owned
    finally:
        engine.close()
    assert _linears(model) == before and all(type(m) is torch.nn.Linear for m in _linears(model).values())
    assert engine_linears(model) == []


def test_a_linear_with_its_own_hook_stays_stock():
    model = copy.deepcopy(make_model("llama"))
    hooked = model.model.layers[0].self_attn.q_proj
    hooked.register_forward_hook(lambda m, i, o: None)
    with PagedGenerator(model, num_blocks=32, block_size=4):
        assert model.model.layers[0].self_attn.q_proj is hooked
        assert type(model.model.layers[0].self_attn.k_proj) is DenseLinear


class _Delta:
    """A LoRA-like slot: y + scale * (x A^T) B^T, counting its calls."""

    def __init__(self, layer: torch.nn.Module, rank: int = 4, scale: float = 2.0, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.a = torch.randn(rank, layer.in_features, generator=g) * 0.3
        self.b = torch.randn(layer.out_features, rank, generator=g) * 0.3
        self.scale, self.calls = scale, 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return y + self.scale * ((x @ self.a.T) @ self.b.T)


def _slots_for(model) -> dict[str, _Delta]:
    return {name: _Delta(layer, seed=i) for i, (name, layer) in enumerate(engine_linears(model))
            if name.rsplit(".", 1)[-1] in TARGETS}


def _stock_with_hooks(model, slots: dict[str, _Delta]):
    """The stock model with each slot as a forward hook on its nn.Linear: the reference for the engine's slots."""
    stock = copy.deepcopy(model)
    for name, module in stock.named_modules():
        if name in slots:
            module.register_forward_hook(lambda m, args, out, s=slots[name]: s(args[0], out))
    return stock


@pytest.mark.parametrize("engine_kw", [
    {},  # CPU defaults: fused layers (q/k/v and gate/up packed as one GEMM each), the native program where it fits
    {"fuse_layers": False, "prepack_weights": False},  # transformers' layers calling each linear
    {"prepack_weights": "native"},  # the native decode program recorded, then set aside while slots are set
])
def test_lora_slots_run_on_every_path_and_match_hooked_stock_generate(engine_kw):
    model = copy.deepcopy(make_model("llama"))
    prompts = make_prompts(3, [5, 9, 3], seed=2)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # (no prefix caching: the slots change the KV of the same prompts; multi-LoRA keys its blocks by adapter)
    with PagedGenerator(model, num_blocks=64, block_size=4, enable_prefix_caching=False, **engine_kw) as engine:
        base = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        program = engine.executor.runner.fast if "prepack_weights" in engine_kw else None
        runs = program.num_runs if program is not None else 0
        assert program is None or runs > 0
        slots = _slots_for(model)
        layers = dict(engine_linears(model))
        assert len(slots) == 4 * model.config.num_hidden_layers
        for name, slot in slots.items():
            layers[name].lora = slot
        with_slots = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        assert all(s.calls > 0 for s in slots.values())
        if program is not None:  # set aside while the slots are set, and saying why
            assert program.num_runs == runs and "LoRA slot" in program.why_not
        for layer in layers.values():
            layer.lora = None
        again = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        assert program is None or program.num_runs > runs
    assert again == base  # taking the slots off gives the base model back (the program re-records)
    assert with_slots != base  # the deltas are large enough to change the tokens
    stock = _stock_with_hooks(model, slots)
    assert with_slots == [stock_greedy(stock, p, MAX_TOKENS) for p in prompts]


def test_lora_slots_on_quantized_layers():
    model = copy.deepcopy(make_model("llama"))
    prompts = make_prompts(2, [6, 4], seed=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with PagedGenerator(model, num_blocks=64, block_size=4, quantization="int8", enable_prefix_caching=False) as engine:
        layers = dict(engine_linears(model))
        assert type(layers["model.layers.0.self_attn.q_proj"]) is QuantLinear
        base = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        slots = _slots_for(model)
        for name, slot in slots.items():
            layers[name].lora = slot
        with_slots = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        for name in slots:
            layers[name].lora = None
        again = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert all(s.calls > 0 for s in slots.values()) and with_slots != base and again == base
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # the float model given back


def test_a_tensor_parallel_slice_is_owned_and_named_as_its_layer():
    from hf_paged.model.layers.linear import OwnedLinears
    from hf_paged.model.layers.parallel import ParallelLinear

    model = copy.deepcopy(make_model("llama"))
    attn = model.model.layers[0].self_attn
    attn.o_proj = ParallelLinear(attn.o_proj, "sum", rank=0, world=1)  # built without a group: no forward here
    owned = OwnedLinears(model)
    names = dict(engine_linears(model))
    assert type(attn.o_proj.base) is DenseLinear and names["model.layers.0.self_attn.o_proj"] is attn.o_proj.base
    assert not any(n.endswith(".base") for n in names)
    owned.remove()
    assert type(attn.o_proj.base) is torch.nn.Linear
