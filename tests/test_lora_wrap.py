"""``hf_paged.wrap`` on a PEFT model: generate with the active adapter, PEFT's per-row ``adapter_names`` and
``disable_adapter()`` run in the engine and equal PEFT's own generate; unwrap gives PEFT's model back."""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

import hf_paged  # noqa: E402
from tests.helpers import make_model, make_prompts  # noqa: E402

KW = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def peft_model():
    base = copy.deepcopy(make_model("qwen2"))
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(2)
    model.add_adapter("other", peft.LoraConfig(init_lora_weights=False, r=8, lora_alpha=4, use_rslora=True,
                                               target_modules=["o_proj", "up_proj", "down_proj"]))
    return model.eval()


def test_wrapped_peft_model_generates_in_the_engine(peft_model):
    prompts = torch.tensor(make_prompts(3, lengths=[12, 12, 12], seed=2))
    kw = dict(attention_mask=torch.ones_like(prompts), **KW)
    names = ["other", "__base__", "default"]
    with torch.no_grad():
        ref_default = peft_model.generate(input_ids=prompts, **kw)
        ref_mixed = peft_model.generate(input_ids=prompts, adapter_names=names, **kw)
        with peft_model.disable_adapter():
            ref_base = peft_model.generate(input_ids=prompts, **kw)
        logits = peft_model(prompts).logits
    assert not torch.equal(ref_default, ref_base)
    hf_paged.wrap(peft_model, num_blocks=64)
    try:
        engine = peft_model.paged
        assert sorted(r.lora_name for r in engine.list_loras()) == ["default", "other"]
        steps = engine.num_steps
        assert torch.equal(peft_model.generate(prompts, **kw), ref_default)
        assert torch.equal(peft_model.generate(prompts, adapter_names=names, **kw), ref_mixed)
        with peft_model.disable_adapter():
            assert torch.equal(peft_model.generate(prompts, **kw), ref_base)
        assert engine.num_steps > steps  # the engine ran them (no fallback to PEFT's generate)
        with pytest.raises(ValueError, match="unknown adapter 'nope'"):
            peft_model.generate(prompts, adapter_names=["nope", "other", "default"], **kw)
        with torch.no_grad():  # a plain forward still applies PEFT's active adapter
            assert torch.allclose(peft_model(prompts).logits, logits)
    finally:
        hf_paged.unwrap(peft_model)
    with torch.no_grad():
        assert torch.equal(peft_model.generate(input_ids=prompts, adapter_names=names, **kw), ref_mixed)


def test_wrapped_model_with_load_adapter_generates_in_the_engine(tmp_path):
    """A transformers model given an adapter with ``load_adapter`` (no PeftModel): ``generate`` with its active
    adapter runs in the engine (PEFT's own layers add the delta around the engine's linears) and equals the
    model's own generate; ``adapter_names`` needs a PeftModel (transformers' generate refuses it as well)."""
    from tests.test_lora import make_adapter

    base = copy.deepcopy(make_model("llama"))
    peft_model = make_adapter(base, tmp_path, seed=5, r=4, target_modules=["q_proj", "v_proj"])
    model = copy.deepcopy(make_model("llama"))
    model.load_adapter(str(tmp_path), adapter_name="x")
    prompts = torch.tensor(make_prompts(2, lengths=[12, 12], seed=6))
    kw = dict(attention_mask=torch.ones_like(prompts), **KW)
    with torch.no_grad():
        ref = model.generate(prompts, **kw)
        assert torch.equal(ref, peft_model.generate(input_ids=prompts, **kw))
        assert not torch.equal(ref, base.generate(prompts, **kw))  # the adapter changes the tokens
    hf_paged.wrap(model, num_blocks=64)
    try:
        engine = model.paged
        steps = engine.num_steps
        assert torch.equal(model.generate(prompts, **kw), ref)
        assert engine.num_steps > steps  # the engine ran it (no fallback to stock generate)
    finally:
        hf_paged.unwrap(model)
