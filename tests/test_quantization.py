"""Quantized models in the engine: ``quantization="int8" | "int4"`` at start, and GGUF files kept quantized."""

import copy
import logging

import pytest
import torch

from hf_paged import EngineConfig, PagedGenerator, SamplingParams
from hf_paged.model.layers.quant_linear import QuantLinear
from hf_paged.model.layers.quantize import QuantizedLinears
from tests.helpers import make_model, make_prompts, stock_greedy


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("activations", ["float", "int8", "bf16"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_engine_equals_stock_generate_on_the_same_quantized_model(quantization, activations):
    """The engine quantizes at start (the LM head as q8_0); stock generate on a copy quantized the same way
    (QuantLinear is a torch module) gives the same tokens, through the fused layers (which call the quantized
    projections) and the native decode program (q/k/v and gate/up joined into one quantized weight each), and
    eagerly, in both kernel modes. On close the float layers and the float head come back."""
    model = make_model(seed=5)
    prompts = make_prompts(5, lengths=[1, 9, 33, 40, 70], seed=2)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    reference = copy.deepcopy(model)
    QuantizedLinears(reference, quantization, activations)
    float_tokens = [stock_greedy(model, p, 16) for p in prompts]
    kw = dict(num_blocks=64, max_num_seqs=3, quantization=quantization, quant_activations=activations)
    with PagedGenerator(model, **kw) as engine:
        linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert len(linears) == 2 * 7 + 1 and model.lm_head.fmt == "q8_0"
        assert {m.activations for m in linears} == {activations}
        program = engine.executor.runner.fast
        assert len(engine.executor.fused.layers) == 2 and type(program).__name__ == "DecodeProgram"
        outs = _tokens(engine.generate(prompts, params, use_tqdm=False))
        assert program.num_runs > 0, program.why_not
    with PagedGenerator(model, enforce_eager=True, **kw) as eager:
        assert _tokens(eager.generate(prompts, params, use_tqdm=False)) == outs
    assert outs == [stock_greedy(reference, p, 16) for p in prompts]
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight or not model.config.tie_word_embeddings
    assert [stock_greedy(model, p, 16) for p in prompts] == float_tokens
    agree = sum(a == b for a, b in zip(outs, float_tokens))
    logging.getLogger(__name__).info("%s: %d/%d prompts equal to the float model's greedy tokens", quantization,
                                     agree, len(prompts))


def test_engines_share_one_quantization_and_refuse_another():
    model = make_model(seed=6)
    with PagedGenerator(model, num_blocks=16, quantization="int8") as a:
        with PagedGenerator(model, num_blocks=16, quantization="int8") as b:
            assert a.executor.quantized is b.executor.quantized
        assert isinstance(model.model.layers[0].mlp.up_proj, QuantLinear)  # still held by a
        with pytest.raises(ValueError, match="another engine on this model runs it with quantization='int8'"):
            PagedGenerator(model, num_blocks=16, quantization="int4")
        # a float engine would run a's int8 layers: refused by name, whichever activation mode it asks for
        for mode in ("float", "auto"):
            with pytest.raises(ValueError, match=r"quantization=None.*another engine.*quantization='int8'"):
                PagedGenerator(model, num_blocks=16, quant_activations=mode)
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear


def test_bad_quantization_names_and_shapes(caplog):
    with pytest.raises(ValueError, match=r"quantization must be None or one of \['int4', 'int8'\], got 'fp8'"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match=r"quant_activations must be one of \('float', 'int8', 'bf16', 'auto'\), got 'int4'"):
        EngineConfig(quantization="int8", quant_activations="int4")
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 40), torch.nn.Linear(40, 4))
    with caplog.at_level(logging.WARNING):
        q = QuantizedLinears(model, "int4")
    assert len(q) == 1 and isinstance(model[0], QuantLinear)
    assert type(model[1]) is torch.nn.Linear and type(model[2]) is torch.nn.Linear
    assert sum("stay float" in r.message and "group size 32" in r.message for r in caplog.records) == 1
    q.remove()
    assert type(model[0]) is torch.nn.Linear


@pytest.fixture(scope="module")
def default_models():
    pytest.importorskip("gguf")
    from hf_paged.model.default_model import load_default

    try:
        quantized, tok = load_default(quantized=True)
    except ImportError as e:
        pytest.skip(str(e))
    return quantized, load_default()[0], tok


CHAT = [
    [{"role": "user", "content": "Write a short poem about the moon."}],
    [{"role": "user", "content": "What is 2 + 2? Answer in one word."}],
]


@pytest.mark.slow
def test_gguf_kept_quantized_equals_the_dequantized_model(default_models):
    """The default model's Q4_1 / Q8_0 tensors as stored (no fp32 copy of them) give the logits and greedy
    tokens of the fp32 model transformers dequantized from the same file, through plain forward, stock
    generate and the engine."""
    quantized, dense, tok = default_models
    layer = quantized.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, QuantLinear) and layer.self_attn.q_proj.fmt == "q4_1"
    assert isinstance(quantized.lm_head, QuantLinear) and quantized.lm_head.fmt == "q8_0"
    assert quantized.lm_head.qweight is quantized.model.embed_tokens.qweight  # tied: one copy of the bytes
    assert not any(p.numel() > 576 for p in quantized.parameters())  # only norms are float
    ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False) for m in CHAT]
    with torch.no_grad():
        x = torch.tensor([ids[0]])
        torch.testing.assert_close(quantized(x).logits, dense(x).logits, atol=2e-3, rtol=1e-4)
        # the Q/K row permutation: rows of q_proj dequantized equal the fp32 model's rows
        assert torch.equal(layer.self_attn.k_proj.dequantize(), dense.model.layers[0].self_attn.k_proj.weight)
    want = [stock_greedy(dense, p, 24) for p in ids]
    assert [stock_greedy(quantized, p, 24) for p in ids] == want
    with PagedGenerator(quantized, num_blocks=64) as engine:
        outs = _tokens(engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False))
    assert outs == want


def test_gguf_unsupported_type_is_a_clear_error(monkeypatch):
    gguf = pytest.importorskip("gguf")
    from hf_paged.model.default_model import gguf_path
    from hf_paged.model import gguf_loader

    try:
        path = gguf_path()
    except ImportError as e:
        pytest.skip(str(e))
    from transformers import AutoConfig
    from hf_paged.model.default_model import default_model_path

    config = AutoConfig.from_pretrained(default_model_path())
    config.num_hidden_layers = 1  # the first tensors decide; fewer layers to build
    monkeypatch.setattr(gguf_loader, "KEPT", ("Q8_0", "Q4_0"))  # as if Q4_1 were a type we cannot run
    with pytest.raises(ValueError, match=r"type Q4_1; hf_paged runs Q8_0, Q4_0 quantized and F32, F16, BF16 as floats"):
        gguf_loader.load_gguf(path, tokenizer=False, config=config)
    assert gguf.GGMLQuantizationType.Q4_1  # the module under test read the real file
    with pytest.raises(ValueError, match="unsupported must be 'error' or 'dequantize'"):
        gguf_loader.load_gguf(path, unsupported="skip")


def test_activation_mode_of_a_quantized_model_is_the_engines_and_comes_back():
    """quant_activations="int8" on a model that is quantized already (as a GGUF one): its QuantLinears switch
    while the engine holds them, back to float on close; another engine asking for float is refused meanwhile."""
    model = copy.deepcopy(make_model(seed=7))  # quantized for good: not the cached model other tests share
    QuantizedLinears(model, "int4")
    prompts = make_prompts(2, lengths=[5, 12], seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with PagedGenerator(model, num_blocks=32, quant_activations="int8") as engine:
        assert {m.activations for m in model.modules() if isinstance(m, QuantLinear)} == {"int8"}
        outs = _tokens(engine.generate(prompts, params, use_tqdm=False))
        assert outs == [stock_greedy(model, p, 8) for p in prompts]
        with pytest.raises(ValueError, match="quant_activations='int8'; close it first"):
            PagedGenerator(model, num_blocks=32, quantization="int8")
    assert {m.activations for m in model.modules() if isinstance(m, QuantLinear)} == {"float"}


def test_gguf_unsupported_type_dequantized_on_request(monkeypatch, caplog):
    """unsupported="dequantize": a type we cannot run loads as floats (the values GGUF's own dequantization
    gives), with one warning; the other tensors stay quantized."""
    pytest.importorskip("gguf")
    from transformers import AutoConfig

    from hf_paged.model.default_model import default_model_path, gguf_path
    from hf_paged.model import gguf_loader

    try:
        path = gguf_path()
    except ImportError as e:
        pytest.skip(str(e))
    config = AutoConfig.from_pretrained(default_model_path())
    config.num_hidden_layers = 1
    monkeypatch.setattr(gguf_loader, "KEPT", ("Q8_0",))  # as if Q4_1 were a type we cannot run
    with caplog.at_level(logging.WARNING, logger="hf_paged.model.gguf_loader"):
        model, _ = gguf_loader.load_gguf(path, tokenizer=False, config=config, unsupported="dequantize")
    assert sum("GGUF tensors of type Q4_1" in r.message for r in caplog.records) == 1
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is torch.nn.Linear and q_proj.weight.dtype == torch.float32
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.fmt == "q8_0"
    monkeypatch.setattr(gguf_loader, "KEPT", ("Q8_0", "Q4_0", "Q4_1"))
    kept, _ = gguf_loader.load_gguf(path, tokenizer=False, config=config)
    assert torch.equal(q_proj.weight, kept.model.layers[0].self_attn.q_proj.dequantize())


def test_quantize_model_for_good_drops_the_float_weights():
    """hf_paged.quantize_model converts in place with no way back: the float weights are freed, the model still
    generates (stock and engine agree, any kernel mode per engine), and bad calls are ValueErrors."""
    import gc
    import weakref

    import hf_paged

    model = copy.deepcopy(make_model(seed=9))  # converted for good: not the cached model other tests share
    embedding = model.get_input_embeddings().weight
    floats = [weakref.ref(m.weight) for m in model.modules()
              if type(m) is torch.nn.Linear and m.weight is not embedding]
    with PagedGenerator(model, num_blocks=16):
        with pytest.raises(ValueError, match="holds this model; close it first"):
            hf_paged.quantize_model(model, "int4")
    with pytest.raises(ValueError, match=r"quantization must be one of \['int4', 'int8'\], got 'q4_k'"):
        hf_paged.quantize_model(model, "q4_k")
    assert hf_paged.quantize_model(model, "int4") is model
    gc.collect()
    assert floats and all(ref() is None for ref in floats)
    assert not any(type(m) is torch.nn.Linear for m in model.modules()) and model.lm_head.fmt == "q8_0"
    prompts = make_prompts(3, lengths=[4, 17, 30], seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = [stock_greedy(model, p, 8) for p in prompts]
    with PagedGenerator(model, num_blocks=32) as engine:
        assert _tokens(engine.generate(prompts, params, use_tqdm=False)) == want
    with PagedGenerator(model, num_blocks=32, quant_activations="bf16") as engine:
        rounded = _tokens(engine.generate(prompts, params, use_tqdm=False))
        assert rounded == [stock_greedy(model, p, 8) for p in prompts]  # the model's layers run the engine's mode
    assert {m.activations for m in model.modules() if isinstance(m, QuantLinear)} == {"float"}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.activations = "int8"
    layers = sum(isinstance(m, QuantLinear) for m in model.modules())
    with pytest.raises(ValueError, match=rf"quantize_model: the model is already quantized \({layers} quantized "
                                         r"linear layers, q4_1, q8_0\) and has no float nn.Linear layer left"):
        hf_paged.quantize_model(model, "int8")  # run twice: says so, not "no nn.Linear layer"
    assert {m.activations for m in model.modules() if isinstance(m, QuantLinear)} == {"int8"}  # left as they were
    with pytest.raises(ValueError, match="quantization='int8': the model has no CPU nn.Linear layer to quantize"):
        hf_paged.quantize_model(torch.nn.Sequential(torch.nn.ReLU()), "int8")  # never had one
    tied = copy.deepcopy(make_model(seed=9, tie_word_embeddings=True))
    hf_paged.quantize_model(tied, "int8")
    assert tied.config.tie_word_embeddings is False and tied.lm_head.fmt == "q8_0"
    tied.tie_weights()  # e.g. from resize_token_embeddings: must not hang a float weight on the quantized head
    assert not hasattr(tied.lm_head, "weight") or not isinstance(tied.lm_head.weight, torch.nn.Parameter)


@pytest.mark.parametrize("activations", ["int8", "bf16"])
@pytest.mark.parametrize("spec", [dict(method="ngram", num_speculative_tokens=3),
                                  dict(method="draft_model", model="self:1", num_speculative_tokens=3)])
def test_speculative_decoding_on_quantized_weights_is_lossless(spec, activations):
    """Greedy speculation (n-gram, and a draft of the target's own first layer) on a model quantized at start gives
    the tokens of stock generate on the same quantized model: the verification forward runs the same row-
    independent kernels (int8 and bf16 modes) with several rows per sequence; the draft runs quantized too."""
    model = make_model(seed=10)
    base = make_prompts(3, lengths=[4, 9, 14], seed=5)
    prompts = [p * 3 for p in base]  # repeats, so n-gram lookups find matches
    reference = copy.deepcopy(model)
    QuantizedLinears(reference, "int4", activations)
    want = [stock_greedy(reference, p, 20) for p in prompts]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with PagedGenerator(model, num_blocks=128, quantization="int4", quant_activations=activations,
                        speculative_config=spec) as engine:
        got = _tokens(engine.generate(prompts, params, use_tqdm=False))
        stats = engine.stats()
        engine.kv_manager.check_consistency()
    assert got == want
    assert stats.spec_num_draft_tokens > 0


def test_bf16_model_with_quantized_weights_runs_the_program_in_bf16():
    """A bf16 model quantized at start, in the bf16 kernel mode: where that mode's kernel runs (AMX-BF16), the
    native decode program runs it on the model's bf16 buffers (bf16 in, bf16 out) and gives the eager engine's
    tokens; elsewhere the program stands aside and says why."""
    from hf_paged.model.layers import quant_linear

    model = make_model(seed=12, dtype=torch.bfloat16)
    prompts = make_prompts(4, lengths=[3, 10, 25, 41], seed=6)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    kw = dict(num_blocks=64, max_num_seqs=3, quantization="int4", quant_activations="bf16")
    with PagedGenerator(model, **kw) as engine:
        program = engine.executor.runner.fast
        outs = _tokens(engine.generate(prompts, params, use_tqdm=False))
        if quant_linear.kernel("bf16")[1] == "bf16":
            assert type(program).__name__ == "DecodeProgram" and program.num_runs > 0, program.why_not
            assert program._x.dtype == torch.bfloat16
        else:
            assert program is None or not program.num_runs
    with PagedGenerator(model, enforce_eager=True, **kw) as eager:
        assert _tokens(eager.generate(prompts, params, use_tqdm=False)) == outs
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the float layers are back
