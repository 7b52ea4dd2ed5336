"""Load EAGLE-1 heads (:mod:`hf_paged.spec_decode.eagle.eagle1`) from folders: ``config.json`` + weights.

A folder that is not an EAGLE-1 head (no config.json, missing weights, an EAGLE-3 head, wrong shapes) or that
does not fit the target (hidden size, vocabulary, a target without a final norm) is a ValueError naming it.
"""

from __future__ import annotations

import logging
import os

import torch

from hf_paged.spec_decode.eagle.eagle1 import REQUIRED, Eagle1Head, final_norm
from hf_paged.spec_decode.eagle.head_files import read_config, read_weights, which_method

logger = logging.getLogger(__name__)


def eagle1_layers(num_target_layers: int) -> tuple[int, ...]:
    """The target layer whose output an EAGLE-1 head reads: the last (its final norm is applied after)."""
    return (num_target_layers - 1,)


def load_eagle1(folder: str, target: torch.nn.Module | None = None, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> Eagle1Head:
    """The EAGLE-1 head in ``folder``, checked against and joined to ``target`` where given.

    Raises:
        ValueError: The folder is not an EAGLE-1 head, or the head does not fit ``target``.
    """
    if not os.path.isdir(folder):
        raise ValueError(f"EAGLE head {folder!r}: no such folder")
    cfg = read_config(folder)
    state = read_weights(folder)
    which_method(folder, cfg, state, "eagle")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        hint = " (a whole model: use method 'draft_model' for it)" if any("layers.1." in k for k in state) else ""
        raise ValueError(f"{folder!r} is not an EAGLE-1 head: its weights lack {missing}{hint}")
    if cfg.num_hidden_layers != 1:
        raise NotImplementedError(f"{folder!r}: an EAGLE head of {cfg.num_hidden_layers} layers; hf_paged loads "
                                  "one-layer heads")
    head = Eagle1Head(cfg, fc_bias="fc.bias" in state, own_embedding="embed_tokens.weight" in state,
                      own_lm_head="lm_head.weight" in state)
    expected = head.state_dict()
    absent = sorted(k for k in expected if k not in state and not k.startswith("rotary."))
    if absent:
        raise ValueError(f"{folder!r} is not an EAGLE-1 head for its config.json: its weights lack {absent}")
    wrong = [f"{k}: {tuple(v.shape)} (expected {tuple(expected[k].shape)})"
             for k, v in state.items() if k in expected and tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        raise ValueError(f"{folder!r}: EAGLE-1 head weights of the wrong shape for its config.json: {wrong}")
    unknown = sorted(k for k in state if k not in expected and k != "layers.0.input_layernorm.weight")
    if unknown:
        logger.warning("EAGLE head %s: ignoring unknown weights %s", folder, unknown[:8])
    head.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    if target is not None:
        check_eagle1(head, target, folder)
        dtype = dtype or next(target.parameters()).dtype
        device = device or next(target.parameters()).device
    head = head.to(device=device)
    if dtype is not None:
        head = head.to(dtype=dtype)
    return head.eval()


def check_eagle1(head: Eagle1Head, target: torch.nn.Module, where: str = "") -> None:
    """ValueError unless ``head`` fits ``target``; joins the target's embedding, lm_head and final norm to it."""
    from hf_paged.model.hf_config import text_config

    where = where or type(head).__name__
    cfg = head.config
    hidden = getattr(text_config(target), "hidden_size", None)
    if hidden != cfg.hidden_size:
        raise ValueError(f"EAGLE-1 head {where!r} has a hidden size of {cfg.hidden_size}, the target's is {hidden}")
    out = target.get_output_embeddings()
    vocab = getattr(out, "out_features", None) or out.weight.shape[0]
    if vocab != cfg.vocab_size:
        raise ValueError(f"EAGLE-1 head {where!r} drafts over a vocabulary of {cfg.vocab_size} tokens, the target's "
                         f"has {vocab}")
    norm = final_norm(target)
    if norm is None:
        raise ValueError(f"EAGLE-1 head {where!r}: the target {type(target).__name__} has no final norm module "
                         "(norm, final_layernorm, ln_f) to give the head its last hidden state")
    head._target_norm[0] = norm
    head._shared_lm_head[0] = out
    head._shared_embedding[0] = target.get_input_embeddings()
