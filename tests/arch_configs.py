"""Tiny seeded random configs of many architectures, for the compatibility matrix (tests/test_architectures.py).

Every model is 2 layers, hidden 64, vocab 512, with an init large enough that greedy picks are decisive.
Sliding windows are shorter than the longer test prompts, so window semantics really matter.
"""

from __future__ import annotations

import functools

import torch
import transformers

VOCAB = 512
WINDOW = 24  # shorter than the long prompts of the matrix

_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.15,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
    tie_word_embeddings=False,
)
_ALTERNATING = ["sliding_attention", "full_attention"]
_MLA = dict(
    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12
)
LLAMA4_CHUNK = 192


def _t(name: str):
    return getattr(transformers, name)


# arch -> (config class, model class, config overrides on top of _BASE)
ARCH_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"head_dim": 16, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,  # scaling differs from head_dim ** -0.5
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "attn_logit_softcapping": 2.0,  # small enough to bend the scores of this init
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
        },
    ),
    "phi": ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5, "qk_layernorm": True}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": WINDOW}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_inner": 128}),
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 128, "word_embed_proj_dim": 64, "init_std": 0.15}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"partial_rotary_factor": 0.5}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": WINDOW}),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {"embedding_multiplier": 2.0, "logits_scaling": 0.5, "residual_multiplier": 0.7, "attention_multiplier": 0.2},
    ),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5, "use_qk_norm": True}),
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        {"logit_scale": 0.5, "sliding_window": WINDOW, "layer_types": _ALTERNATING},
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]}),
    # -- beyond the list of issue 4 --------------------------------------------------------------------
    # multi-head latent attention: value head size (12) differs from the query/key size (16)
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {**_MLA, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    ),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", _MLA),
    # KV sharing: the last layer reuses the K/V of an earlier one
    "gemma3n": (
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING * 2,
            "num_kv_shared_layers": 2,
            "vocab_size_per_layer_input": VOCAB,
            "hidden_size_per_layer_input": 16,
            "laurel_rank": 8,
            "altup_num_inputs": 2,
            "activation_sparsity_pattern": [0.0] * 4,
        },
    ),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {"multi_query": True, "n_inner": 128}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"sliding_window": WINDOW, "layer_types": _ALTERNATING}),
    "ministral": (
        "MinistralConfig",
        "MinistralForCausalLM",
        {"head_dim": 16, "sliding_window": WINDOW, "layer_types": _ALTERNATING},
    ),
    # chunked local attention (every layer but each 4th): exact only within one chunk, so the engine caps
    # max_model_len at attention_chunk_size (the matrix prompts + outputs fit in it)
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {"head_dim": 16, "attention_chunk_size": LLAMA4_CHUNK}),
}

# arch -> (config class, model class, overrides, the NotImplementedError message (regex), reason for README)
UNSUPPORTED: dict[str, tuple[str, str, dict, str, str]] = {
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "layer_types": ["full_attention"] * 2},
        "GptOssAttention uses attention sinks",
        "attention sinks (`s_aux`) are not in the paged kernels yet",
    ),
    "diffllama": (
        "DiffLlamaConfig",
        "DiffLlamaForCausalLM",
        {},
        "DiffLlamaAttention calls the attention function 2 times per layer",
        "differential attention calls the attention function twice per layer with different values; "
        "one KV pool per layer cannot hold both",
    ),
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        {"layer_types": ["full_attention", "conv"]},
        r"Lfm2ForCausalLM: decoder layers \[1\] do not call the attention function",
        "hybrid: convolution layers keep per-sequence state that is not paged (same check rejects "
        "Mamba/linear-attention hybrids)",
    ),
    "nemotron": (
        "NemotronConfig",
        "NemotronForCausalLM",
        {"head_dim": 16},
        "NemotronForCausalLM does not pass keyword arguments through",
        "its decoder layer drops `**kwargs` before the attention call, so the per-step metadata never reaches it",
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        {"alibi": False, "new_decoder_architecture": False},
        "FalconForCausalLM does not support transformers' attention interface",
        "does not route attention through transformers' attention interface (`_supports_attention_backend` "
        "is False; likewise bloom, gptj, gpt_neo, codegen, mpt, stablelm)",
    ),
}


@functools.lru_cache(maxsize=None)
def _cached_model(arch: str, seed: int, extra: tuple):
    config_name, model_name, overrides = ARCH_CONFIGS[arch] if arch in ARCH_CONFIGS else UNSUPPORTED[arch][:3]
    extra_kw = {k: list(v) if isinstance(v, tuple) else v for k, v in extra}
    config = _t(config_name)(**{**_BASE, **overrides, **extra_kw})
    torch.manual_seed(seed)
    model = _t(model_name)(config).float().eval()
    model._hf_paged_test_default_attn = model.config._attn_implementation
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_arch_model(arch: str, seed: int = 0, attn_implementation: str | None = None, **extra):
    """A tiny random model of ``arch`` (cached per seed and config ``extra``), reset to ``attn_implementation``.

    ``None`` means the implementation transformers picked at construction ("sdpa", or "eager" for models
    such as Gemma2 that do not support sdpa).
    """
    key = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(extra.items()))  # hashable
    model = _cached_model(arch, seed, key)
    attn_implementation = attn_implementation or model._hf_paged_test_default_attn
    if model.config._attn_implementation != attn_implementation:
        model.set_attn_implementation(attn_implementation)
    return model

# What each supported config exercises beyond plain causal RoPE attention (docs/getting_started.md, supported models).
FEATURES: dict[str, str] = {
    "llama": "GQA",
    "mistral": "sliding window",
    "qwen2": "QKV bias",
    "qwen3": "QK norm, sliding window on layer 2 (`max_window_layers`)",
    "gemma": "explicit head_dim, scaled embeddings",
    "gemma2": "attention logit softcap, sliding/full layers, `query_pre_attn_scalar` scaling, eager original",
    "gemma3": "sliding/full layers with separate RoPE, `query_pre_attn_scalar` scaling",
    "phi": "partial rotary, QK layernorm",
    "phi3": "fused QKV, sliding window",
    "gpt2": "learned absolute positions, fused QKV",
    "opt": "learned positions (offset 2), query pre-scaled (`scaling=1.0`)",
    "gpt_neox": "partial rotary, parallel residual",
    "olmo2": "QK norm over all heads",
    "starcoder2": "sliding window, biases",
    "granite": "`attention_multiplier` scaling, embedding/residual/logit multipliers",
    "cohere": "QK norm, logit scale, parallel block",
    "cohere2": "sliding/full layers (NoPE on full layers)",
    "mixtral": "MoE, sliding window",
    "qwen3_moe": "MoE, QK norm",
    "smollm3": "NoPE layers",
    "deepseek_v3": "multi-head latent attention (V head 12 != QK head 16), MoE",
    "minicpm3": "multi-head latent attention (V head 12 != QK head 16)",
    "gemma3n": "KV sharing across layers, AltUp, per-layer inputs, sliding/full layers",
    "gpt_bigcode": "multi-query attention",
    "qwen2_moe": "MoE with shared expert",
    "olmoe": "MoE, QK norm",
    "glm4": "partial rotary, extra norms",
    "exaone4": "sliding/full layers, QK norm",
    "ministral": "sliding/full layers",
    "llama4": f"chunked local attention: exact up to one chunk, so `max_model_len` is capped at "
    f"`attention_chunk_size` (test chunk {LLAMA4_CHUNK})",
}
