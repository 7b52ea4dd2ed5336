"""The fused CPU forward (cpu/fused_layers.py) and the native decode program (cpu/program_fit.py) take transformers'
own Llama/Mistral/Qwen2 classes only, matched by identity: a subclass, or a remote-code copy with the same class
name, may change the math, and must run its own forward (and still match stock ``generate`` exactly)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.llama import modeling_llama

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.model.layers.fused_decoder import FusedLayers, _why_not
from hf_paged.executor.program_fit import why_not
from tests.helpers import make_model, make_prompts, stock_greedy

NATIVE = dict(prepack_weights="native")  # the packing the native program runs on (as in test_native_program)
MAX_TOKENS = 12


# Same class names (and children, and SiLU) as transformers' classes, other math: only identity tells them apart.
class LlamaDecoderLayer(modeling_llama.LlamaDecoderLayer):
    """The layer's update to the residual stream counts half."""

    def forward(self, hidden_states, *args, **kwargs):
        out = super().forward(hidden_states, *args, **kwargs)
        return hidden_states + 0.5 * (out - hidden_states)


class LlamaMLP(modeling_llama.LlamaMLP):
    """Gate and up projections swapped."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


class LlamaRMSNorm(modeling_llama.LlamaRMSNorm):
    """Normalizes a shifted input."""

    def forward(self, hidden_states):
        return super().forward(hidden_states + 1.0)


class LlamaModel(modeling_llama.LlamaModel):
    """Scaled embeddings (as Gemma's): the native program embeds the tokens itself."""

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * 2.0
        return super().forward(inputs_embeds=inputs_embeds, **kwargs)


class LlamaForCausalLM(modeling_llama.LlamaForCausalLM):
    pass


def _swap(module: torch.nn.Module, cls: type, *args) -> torch.nn.Module:
    """An instance of ``cls(*args)`` holding ``module``'s weights."""
    new = cls(*args)
    new.load_state_dict(module.state_dict())
    return new.eval()


def _variant(kind: str) -> torch.nn.Module:
    """A copy of the tiny Llama with some modules replaced by the same-named subclasses above."""
    model = copy.deepcopy(make_model("llama", seed=21))  # make_model's models are shared: change a copy
    config = model.config
    for i, layer in enumerate(model.model.layers):
        if kind == "layer":
            model.model.layers[i] = _swap(layer, LlamaDecoderLayer, config, i)
        elif kind == "mlp":
            layer.mlp = _swap(layer.mlp, LlamaMLP, config)
    if kind == "norm":
        model.model.norm = _swap(model.model.norm, LlamaRMSNorm, config.hidden_size, config.rms_norm_eps)
    elif kind == "model":
        model.model = _swap(model.model, LlamaModel, config)
    return model


def _prompts():
    return make_prompts(4, lengths=[3, 17, 40, 9], seed=21)


def test_stock_llama_is_still_fused_and_fits_the_program():
    model = make_model("llama", seed=21)
    fused = FusedLayers(model)
    try:
        assert len(fused) == model.config.num_hidden_layers > 0
    finally:
        fused.remove()
    assert why_not(model, None, None) == "it needs the fused layers and packed (or quantized) linears"  # past the class checks


@pytest.mark.parametrize("kind", ["layer", "mlp"])
def test_same_named_subclass_layers_are_not_fused_and_match_stock(kind):
    model = _variant(kind)
    stock = make_model("llama", seed=21)
    prompts = _prompts()
    want = [stock_greedy(model, p, MAX_TOKENS) for p in prompts]
    # the subclass really changes the math (else parity below would not tell the fused forward from its own)
    assert want != [stock_greedy(stock, p, MAX_TOKENS) for p in prompts]
    reason = _why_not(model.model.layers[0])
    if kind == "layer":
        assert "test_layer_identity.LlamaDecoderLayer is not transformers' LlamaDecoderLayer" in reason
    else:
        assert "mlp is tests.test_layer_identity.LlamaMLP, expected transformers' LlamaMLP" in reason
    fused = FusedLayers(model)
    try:
        assert len(fused) == 0
    finally:
        fused.remove()
    with PagedGenerator(model, num_blocks=48, block_size=8, max_num_seqs=3, **NATIVE) as engine:
        assert engine.fused is None
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_same_named_copy_of_a_layer_class_is_not_fused():
    """A remote-code copy: not a subclass, the same name, children and forward code."""
    layer = make_model("llama", seed=21).model.layers[0]
    copied = type("LlamaDecoderLayer", (torch.nn.Module,), {"forward": modeling_llama.LlamaDecoderLayer.forward})
    module = copied()
    for name, child in layer.named_children():
        module.add_module(name, child)
    assert "is not transformers' LlamaDecoderLayer (a subclass or a copy)" in _why_not(module)


def test_same_named_causal_lm_subclass_does_not_fit_the_native_program():
    sub = LlamaForCausalLM(make_model("llama", seed=21).config)
    assert "test_layer_identity.LlamaForCausalLM is not transformers' LlamaForCausalLM" in why_not(sub, None, None)


@pytest.mark.parametrize("kind,reason", [
    ("model", "model.model is tests.test_layer_identity.LlamaModel, expected transformers' LlamaModel"),
    ("norm", "the final norm is tests.test_layer_identity.LlamaRMSNorm, expected transformers' LlamaRMSNorm"),
], ids=["model", "norm"])
def test_same_named_subclass_modules_do_not_take_the_native_program_and_match_stock(kind, reason):
    model = _variant(kind)
    prompts = _prompts()
    want = [stock_greedy(model, p, MAX_TOKENS) for p in prompts]
    stock = make_model("llama", seed=21)
    assert want != [stock_greedy(stock, p, MAX_TOKENS) for p in prompts]
    with pytest.raises(ValueError, match=f"cannot run this model: {reason}"):
        PagedGenerator(model, num_blocks=48, decode_runner="native", **NATIVE)
    with PagedGenerator(model, num_blocks=48, block_size=8, max_num_seqs=3, **NATIVE) as engine:
        assert engine.fused is not None  # the layers are stock: still fused
        assert why_not(model, engine.fused, engine.packed) == reason
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
