"""EAGLE-1 draft heads (``"method": "eagle"``) in the layout vLLM's ``llama_eagle.py`` loads.

An EAGLE-1 head drafts from the target's last hidden state (the output of its final norm, the input of its
``lm_head``) instead of three layers: ``fc`` (2H -> H, an optional bias) projects the token embedding and that
hidden state side by side, one Llama decoder layer follows whose ``input_layernorm`` is left out (the published
heads have none), and the target's own ``lm_head`` gives the logits of the layer's output, which is also the
hidden state fed back for the next draft. The HASS variant (``add_para_norm`` in ``config.json``) norms the two
halves first (``embedding_layernorm``, ``hidden_states_layernorm``). Weight names: ``fc``, ``layers.0.*`` (with
or without a leading ``model.``), the optional norms above, an optional ``embed_tokens`` and ``lm_head`` (the
target's are used where the head has none).

The head keeps the EAGLE-3 head's interface (:class:`~hf_paged.spec_decode.eagle.head.EagleHead`): ``feed``,
``forward``, ``logits``, ``to_target``, so one proposer drafts with either.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged.spec_decode.eagle.head import Attend, EagleHead, EagleHeadConfig, _Attention, _MLP, _RMSNorm

ARCHITECTURE = "EagleLlamaForCausalLM"  # vLLM's registry name for these heads

REQUIRED = (
    "fc.weight",
    *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    "layers.0.post_attention_layernorm.weight",
)


class _Layer(nn.Module):
    def __init__(self, cfg: EagleHeadConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg, inputs=1)
        self.mlp = _MLP(cfg)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Eagle1Head(nn.Module):
    """An EAGLE-1 head (see the module docstring).

    Args:
        config: Its configuration (``extra`` may hold ``add_para_norm``; ``fc_bias`` says whether ``fc`` has a bias).
        fc_bias: ``fc`` has a bias (the original EAGLE checkpoints do, vLLM's own training does not).
        own_embedding: The head has an ``embed_tokens`` of its own.
        own_lm_head: The head has an ``lm_head`` of its own.
    """

    method = "eagle"

    def __init__(self, config: EagleHeadConfig, fc_bias: bool = False, own_embedding: bool = False,
                 own_lm_head: bool = False) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        cfg = self.config = config
        cfg.extra.setdefault("architectures", [ARCHITECTURE])
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList([_Layer(cfg)])
        self.para_norm = bool(cfg.extra.get("add_para_norm", False))
        self.embedding_layernorm = _RMSNorm(h, cfg.rms_norm_eps) if self.para_norm else None
        self.hidden_states_layernorm = _RMSNorm(h, cfg.rms_norm_eps) if self.para_norm else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embedding else None
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False) if own_lm_head else None
        # the target's modules where the head has none (lists: not submodules, not in the state dict)
        self._shared_embedding: list[nn.Module | None] = [None]
        self._shared_lm_head: list[nn.Module | None] = [None]
        self._target_norm: list[nn.Module | None] = [None]
        self.rotary = LlamaRotaryEmbedding(cfg.llama_config())

    embed = EagleHead.embed  # the same lookup: the head's own embed_tokens, else the target's

    def feed(self, rows: torch.Tensor) -> torch.Tensor:
        """The target's last hidden state from its captured last decoder layer output: its final norm applied."""
        norm = self._target_norm[0]
        if norm is None:
            raise ValueError("this EAGLE head was given no target final norm (load it with its target)")
        return norm(rows.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The head's output ``[T, H]`` (its logits' input, fed back as the next draft's hidden state).

        Args:
            input_ids: ``[T]`` the token after each position.
            positions: ``[T]`` the positions (of the hidden states).
            hidden: ``[T, H]``: the target's last hidden state (:meth:`feed`) or the head's own output.
            attend: Paged or plain causal attention.
        """
        cfg, layer = self.config, self.layers[0]
        embeds = self.embed(input_ids)
        if self.para_norm:
            embeds, hidden = self.embedding_layernorm(embeds), self.hidden_states_layernorm(hidden)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        residual = layer.self_attn.attend(cfg, x, positions, self._rope, attend) + x  # no input_layernorm
        return layer.mlp(layer.post_attention_layernorm(residual)) + residual

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits ``[N, V]`` of head outputs ``[N, H]`` (the head's or the target's lm_head)."""
        head = self.lm_head if self.lm_head is not None else self._shared_lm_head[0]
        if head is None:
            raise ValueError("this EAGLE head has no lm_head of its own and was given no target lm_head")
        return head(out)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids  # EAGLE-1 drafts over the target's whole vocabulary

    _rope = EagleHead._rope


def final_norm(target: nn.Module) -> nn.Module | None:
    """The target's final norm (the module between its last decoder layer and its ``lm_head``), if it has one."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    for name in ("norm", "final_layernorm", "ln_f"):
        module = getattr(decoder, name, None)
        if isinstance(module, nn.Module):
            return module
    return None
