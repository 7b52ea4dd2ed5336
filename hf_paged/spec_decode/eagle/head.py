"""The EAGLE-3 draft head as a torch module, in the layout vLLM and SpecForge load.

The head drafts the token after position ``p + 1`` from two inputs at position ``p``: the embedding of token
``p + 1`` and a hidden state. On the first draft of a step that hidden state is the target's: the outputs of
three of its decoder layers (early, middle, late) concatenated and projected by ``fc`` (3H -> H). Each further
draft feeds back the head's own output (``prenorm``, H). One decoder layer follows whose attention input is
the two halves side by side (2H: ``input_layernorm`` of the embedding, ``hidden_norm`` of the hidden state),
then ``norm`` and ``lm_head`` over a draft vocabulary; ``d2t[i]`` is the offset from draft id ``i`` to its
target id. Weight names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, optional
``embed_tokens``) are those of the published checkpoints, so a head's state dict is the checkpoint's.

Attention is a callable the caller passes (``attend(q, k, v) -> out``): the proposer's paged attention over
the head's own KV pool, or :func:`causal_attend` for a plain forward over one whole sequence (tests, trainer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # q [T,H,D], k/v [T,KVH,D] -> [T,H,D]


@dataclass
class EagleHeadConfig:
    """The fields of a head's ``config.json`` that its shapes and math depend on (names as published)."""

    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (d2t maps into it)
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    draft_vocab_size: int | None = None  # rows of lm_head (default: vocab_size)
    target_hidden_size: int | None = None  # the target's hidden size (default: hidden_size)
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    norm_before_residual: bool = False
    num_hidden_layers: int = 1
    aux_layer_ids: list[int] | None = None  # eagle_config.eagle_aux_hidden_state_layer_ids (vLLM's convention)
    extra: dict[str, Any] = field(default_factory=dict)  # the rest of config.json, written back as it was

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size

    @classmethod
    def from_dict(cls, raw: dict) -> EagleHeadConfig:
        known = set(cls.__dataclass_fields__) - {"extra", "aux_layer_ids"}
        kwargs = {k: raw[k] for k in known if raw.get(k) is not None}
        eagle = raw.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
        extra = {k: v for k, v in raw.items() if k not in known}
        return cls(**kwargs, aux_layer_ids=list(ids) if ids is not None else None, extra=extra)

    def to_dict(self) -> dict:
        out = dict(self.extra)
        out.setdefault("architectures", ["LlamaForCausalLMEagle3"])
        out.setdefault("model_type", "llama")
        for name in self.__dataclass_fields__:
            if name not in ("extra", "aux_layer_ids"):
                out[name] = getattr(self, name)
        if self.aux_layer_ids is not None:
            eagle = dict(out.get("eagle_config") or {})
            eagle["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
            out["eagle_config"] = eagle
        return out

    def llama_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           intermediate_size=self.intermediate_size, hidden_act=self.hidden_act,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                           max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size,
                           num_hidden_layers=1)


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: EagleHeadConfig, inputs: int = 2) -> None:
        super().__init__()
        h, nh, nkv, hd, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(inputs * h, nh * hd, bias=bias)
        self.k_proj = nn.Linear(inputs * h, nkv * hd, bias=bias)
        self.v_proj = nn.Linear(inputs * h, nkv * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=bias)

    def attend(self, cfg: EagleHeadConfig, x: torch.Tensor, positions: torch.Tensor, rope, attend: Attend) -> torch.Tensor:
        """``o_proj`` of attention over ``x`` ``[T, inputs * H]`` (RoPE by ``rope(q, k, positions)``)."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).view(t, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).view(t, cfg.num_key_value_heads, cfg.head_dim)
        q, k = rope(q, k, positions)
        return self.o_proj(attend(q, k, v).reshape(t, cfg.num_attention_heads * cfg.head_dim))


class _MLP(nn.Module):
    def __init__(self, cfg: EagleHeadConfig) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, cfg: EagleHeadConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class EagleHead(nn.Module):
    """An EAGLE-3 head (see the module docstring).

    Args:
        config: Its configuration.
        embed_tokens: The target's input embedding, used where the head has none of its own (kept outside
            the state dict: it is the target's).
        own_embedding: Give the head an ``embed_tokens`` of its own (a checkpoint that has one).
    """

    def __init__(self, config: EagleHeadConfig, embed_tokens: nn.Module | None = None, own_embedding: bool = False) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        cfg = self.config = config
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        self._shared_embedding = [embed_tokens]  # a list: not a submodule, not in the state dict
        self.rotary = LlamaRotaryEmbedding(cfg.llama_config())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self._shared_embedding[0]
        if table is None:
            raise ValueError("this EAGLE head has no embed_tokens of its own and was given no target embedding")
        return table(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The head's output before its final norm (``prenorm`` ``[T, H]``, fed back as the next draft's hidden).

        Args:
            input_ids: ``[T]`` the token after each position.
            positions: ``[T]`` the positions (of the hidden states).
            hidden: ``[T, H]``: ``fc`` of the target's hidden states, or the head's own ``prenorm``.
            attend: Paged or plain causal attention (see the module docstring).
        """
        cfg, layer = self.config, self.midlayer
        embeds = layer.input_layernorm(self.embed(input_ids))
        normed = layer.hidden_norm(hidden)
        residual = normed if cfg.norm_before_residual else hidden
        x = torch.cat([embeds, normed], dim=-1)
        residual = layer.self_attn.attend(cfg, x, positions, self._rope, attend) + residual
        return layer.mlp(layer.post_attention_layernorm(residual)) + residual

    def feed(self, rows: torch.Tensor) -> torch.Tensor:
        """The hidden input of the catch-up forward from the target's captured rows ``[T, 3H]``: ``fc`` of them."""
        return self.fc(rows.to(self.fc.weight.dtype))

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[N, draft_vocab_size]`` of head outputs ``[N, H]``."""
        return self.lm_head(self.norm(prenorm))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary ids."""
        return draft_ids + self.d2t[draft_ids]

    def _rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cos, sin = self.rotary(q, positions.view(1, -1))  # [1, T, D]
        q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1)


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over one whole sequence (``[T, H, D]``; GQA by repeating the KV heads)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)
