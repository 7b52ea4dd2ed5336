"""Load and save EAGLE-3 heads as folders: ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``).

Weight names follow the published heads (vLLM's ``llama_eagle3.py`` and SpecForge read the same): ``fc``,
``midlayer.*`` (also accepted as ``layers.0.*``, with or without a leading ``model.``), ``norm``, ``lm_head``,
``d2t``, ``t2d`` and an optional ``embed_tokens``. A folder that is not a head, or a head that does not fit
the target (hidden size, vocabulary, layers to read), is a ValueError naming the folder and what is wrong.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from hf_paged.spec_decode.eagle.head import EagleHead, EagleHeadConfig
from hf_paged.spec_decode.eagle.head_files import read_config, read_weights, which_method

logger = logging.getLogger(__name__)

REQUIRED = (
    "fc.weight", "norm.weight", "lm_head.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
)


def aux_layers(config: EagleHeadConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target's decoder layers whose outputs the head reads, in the order ``fc`` concatenates them.

    Published configs count as vLLM does: id ``i`` is the hidden state entering layer ``i`` (the output of
    layer ``i - 1``); without ids, vLLM's default ``(2, L // 2, L - 3)``."""
    ids = config.aux_layer_ids
    if ids is None:
        ids = [2, num_target_layers // 2, num_target_layers - 3]
    if len(ids) != 3:
        raise ValueError(f"an EAGLE-3 head reads 3 target layers, its config names {list(ids)}")
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i < num_target_layers]
    if bad:
        raise ValueError(
            f"EAGLE-3 hidden-state layer ids {bad} do not fit a target of {num_target_layers} decoder layers "
            f"(ids count the state entering layer i: 1 .. {num_target_layers - 1}; a target this shallow needs "
            "eagle_config.eagle_aux_hidden_state_layer_ids in the head's config.json)")
    return tuple(i - 1 for i in ids)


def _eagle3_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}


def load_head(folder: str, target: torch.nn.Module | None = None, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None, method: str = "eagle3"):
    """The EAGLE-3 head (``method="eagle"``: the EAGLE-1 head) in ``folder``, checked against ``target`` where given.

    Raises:
        ValueError: The folder is not a head (no config.json, missing weights, wrong shapes), or the head does
            not fit ``target`` (its hidden size, vocabulary or number of layers).
    """
    if method == "eagle":
        from hf_paged.spec_decode.eagle.eagle1_loading import load_eagle1

        return load_eagle1(folder, target, dtype, device)
    if not os.path.isdir(folder):
        raise ValueError(f"EAGLE head {folder!r}: no such folder")
    cfg = read_config(folder)
    state = read_weights(folder)
    which_method(folder, cfg, state, "eagle3")
    state = _eagle3_names(state)
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        hint = " (a whole model: use method 'draft_model' for it)" if any(".layers.1." in k for k in state) else ""
        raise ValueError(f"{folder!r} is not an EAGLE-3 head: its weights lack {missing}{hint}")
    if cfg.num_hidden_layers != 1:
        raise NotImplementedError(f"{folder!r}: an EAGLE head of {cfg.num_hidden_layers} layers; hf_paged loads "
                                  "one-layer heads")
    if target is not None:  # what the config says first: a head for another model fails on that, not on a shape
        _check_fits(folder, cfg, target, own_embedding="embed_tokens.weight" in state)
    head = EagleHead(cfg, own_embedding="embed_tokens.weight" in state)
    expected = head.state_dict()
    wrong = [f"{k}: {tuple(v.shape)} (expected {tuple(expected[k].shape)})"
             for k, v in state.items() if k in expected and tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        raise ValueError(f"{folder!r}: EAGLE head weights of the wrong shape for its config.json: {wrong}")
    unknown = sorted(k for k in state if k not in expected)
    if unknown:
        logger.warning("EAGLE head %s: ignoring unknown weights %s", folder, unknown[:8])
    if "d2t" not in state and cfg.draft_vocab_size != cfg.vocab_size:
        raise ValueError(f"{folder!r}: a draft vocabulary of {cfg.draft_vocab_size} tokens (not the target's "
                         f"{cfg.vocab_size}) needs the d2t offsets, which its weights lack")
    head.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    if target is not None:
        check_head(head, target, folder)
    elif _d2t_outside(head):
        raise ValueError(f"{folder!r}: d2t maps draft tokens outside the vocabulary [0, {cfg.vocab_size})")
    if dtype is None and target is not None:
        dtype = next(target.parameters()).dtype
    if device is None and target is not None:
        device = next(target.parameters()).device
    head = head.to(device=device)
    if dtype is not None:  # the float weights only: d2t stays long, t2d bool
        head = head.to(dtype=dtype)
    return head.eval()


def _d2t_outside(head: EagleHead) -> bool:
    ids = head.to_target(torch.arange(head.config.draft_vocab_size, device=head.d2t.device))
    return bool(ids.numel()) and (int(ids.min()) < 0 or int(ids.max()) >= head.config.vocab_size)


def check_head(head: EagleHead, target: torch.nn.Module, where: str = "") -> None:
    """ValueError unless ``head`` fits ``target`` (hidden size, vocabulary, layers, d2t); a head without an
    embedding of its own is given the target's."""
    where = where or type(head).__name__
    if _d2t_outside(head):
        raise ValueError(f"EAGLE head {where!r}: d2t maps draft tokens outside the vocabulary [0, {head.config.vocab_size})")
    embedding = _check_fits(where, head.config, target, own_embedding=head.embed_tokens is not None)
    if head.embed_tokens is None:
        head._shared_embedding[0] = embedding


def _check_fits(folder: str, cfg: EagleHeadConfig, target: torch.nn.Module, own_embedding: bool) -> torch.nn.Module:
    from hf_paged.executor.step_runners import decoder_layers
    from hf_paged.model.hf_config import text_config

    tcfg = text_config(target)
    hidden = getattr(tcfg, "hidden_size", None)
    if hidden != cfg.target_hidden_size:
        raise ValueError(f"EAGLE head {folder!r} reads hidden states of size {cfg.target_hidden_size}, the target's "
                         f"are {hidden}")
    out = target.get_output_embeddings()
    vocab = getattr(out, "out_features", None) or out.weight.shape[0]
    if vocab != cfg.vocab_size:
        raise ValueError(f"EAGLE head {folder!r} drafts over a vocabulary of {cfg.vocab_size} tokens, the target's "
                         f"has {vocab}")
    try:
        aux_layers(cfg, len(decoder_layers(target)))
    except ValueError as e:
        raise ValueError(f"EAGLE head {folder!r}: {e}") from None
    embedding = target.get_input_embeddings()
    if not own_embedding and embedding.weight.shape[-1] != cfg.hidden_size:
        raise ValueError(f"EAGLE head {folder!r} has no embed_tokens and a hidden size of {cfg.hidden_size}, so it "
                         f"needs the target's embedding, whose size is {embedding.weight.shape[-1]}")
    return embedding


def save_head(head: EagleHead, folder: str) -> None:
    """Write ``head`` as ``config.json`` + ``model.safetensors`` (the layout :func:`load_head` and vLLM read)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(head.config.to_dict(), f, indent=2)
    save_file(state, os.path.join(folder, "model.safetensors"))
