"""Reading an EAGLE head folder (``config.json`` and its weights), shared by the EAGLE-3 and EAGLE-1 loaders."""

from __future__ import annotations

import json
import os

import torch

from hf_paged.spec_decode.eagle.head import EagleHeadConfig

_CONFIG_KEYS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def read_config(folder: str) -> EagleHeadConfig:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder!r} is not an EAGLE head folder: it has no config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{folder!r}: config.json cannot be read as JSON: {e}") from e
    missing = [k for k in _CONFIG_KEYS if not isinstance(raw.get(k), int)]
    if missing:
        raise ValueError(f"{folder!r} is not an EAGLE head: config.json lacks integer {missing}")
    try:
        return EagleHeadConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{folder!r}: config.json does not describe an EAGLE head: {e}") from e


def read_weights(folder: str) -> dict[str, torch.Tensor]:
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for name in files:
            state.update(load_file(os.path.join(folder, name)))
    elif os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
        state = torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{folder!r} is not an EAGLE head folder: no *.safetensors or pytorch_model.bin weights")
    return {(k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()}


def which_method(folder: str, cfg: EagleHeadConfig, state: dict[str, torch.Tensor], wanted: str) -> None:
    """ValueError when the folder holds the other kind of EAGLE head (told by ``fc``'s input width)."""
    fc = state.get("fc.weight")
    if fc is None or fc.dim() != 2:
        return
    width = fc.shape[1]
    if wanted == "eagle3" and width == 2 * cfg.hidden_size and width != 3 * cfg.target_hidden_size:
        raise ValueError(f"{folder!r} is an EAGLE-1 head (fc takes 2 x {cfg.hidden_size}): use method 'eagle'")
    if wanted == "eagle" and width == 3 * cfg.target_hidden_size:
        raise ValueError(f"{folder!r} is an EAGLE-3 head (fc takes 3 x {cfg.target_hidden_size}): use method 'eagle3'")
