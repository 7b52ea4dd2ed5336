"""Reading a PEFT LoRA folder, checked against the base model at load.

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``,
``rank_pattern``, ``alpha_pattern``, ...) and ``adapter_model.safetensors`` (or ``adapter_model.bin``) with, per
adapted linear, ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``.
Everything is checked here, once, so a bad folder fails its ``add_lora`` with a message naming the file and
the mismatch, and never a step.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hf_paged.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT's prefix of every saved key (the PeftModel wraps the causal LM as base_model.model)
_PREFIX = "base_model.model."
# modules whose adapters change the vocabulary side: the slot sits on linears inside decoder layers only
REFUSED_TARGETS = ("embed_tokens", "lm_head", "wte", "wpe", "embed_out", "word_embeddings")


@dataclass
class LoRALayerWeights:
    """One adapted linear: ``delta = scale * (x @ a.T) @ b.T``."""

    a: torch.Tensor  # [rank, in_features], fp32 on the host
    b: torch.Tensor  # [out_features, rank], fp32 on the host
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAWeights:
    """A loaded adapter: its request and its weights per base-model module name."""

    request: LoRARequest
    layers: dict[str, LoRALayerWeights]

    @property
    def max_rank(self) -> int:
        return max(w.rank for w in self.layers.values())


def load_lora(request: LoRARequest, targets: Mapping[str, tuple[int, int]], max_lora_rank: int) -> LoRAWeights:
    """Read and check the PEFT folder of ``request``.

    Args:
        request: The adapter to load.
        targets: The base model's linears an adapter may adapt: module name -> ``(in_features, out_features)``.
        max_lora_rank: The engine's largest rank.

    Raises:
        ValueError: The folder is missing, not a LoRA adapter, or does not fit the base model; the message
            names the file and the mismatch.
    """
    folder = request.lora_path
    if not os.path.isdir(folder):
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {folder!r} is not a folder")
    config = _read_config(os.path.join(folder, CONFIG_FILE))
    weights_file = next((os.path.join(folder, f) for f in WEIGHT_FILES if os.path.isfile(os.path.join(folder, f))), None)
    if weights_file is None:
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {folder!r} holds neither of {list(WEIGHT_FILES)}")
    tensors = _read_tensors(weights_file)
    pairs = _pair_weights(tensors, weights_file)
    if not pairs:
        raise ValueError(f"{weights_file}: no lora_A/lora_B weights in it")
    layers = {}
    for name, (a, b) in sorted(pairs.items()):
        module = _resolve(name, targets, weights_file)
        in_f, out_f = targets[module]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape != (out_f, rank):
            raise ValueError(
                f"{weights_file}: {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
                f"model's {module} (in_features={in_f}, out_features={out_f}): expected lora_A [r, {in_f}] and "
                f"lora_B [{out_f}, r]"
            )
        if rank > max_lora_rank:
            raise ValueError(f"{weights_file}: {name} has rank {rank}, above the engine's max_lora_rank="
                             f"{max_lora_rank} (raise max_lora_rank)")
        layers[module] = LoRALayerWeights(a.float().contiguous(), b.float().contiguous(), _scale(config, module, rank))
    return LoRAWeights(request, layers)


def _read_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: not found (a PEFT adapter folder needs it)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if config.get(key) is bad:
            raise ValueError(f"{path}: {key}=true is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={config['bias']!r} is not supported (only 'none')")
    refused = _refused_names(config.get("target_modules")) + _refused_names(config.get("modules_to_save"))
    if refused:
        raise ValueError(f"{path}: adapters of {sorted(set(refused))} are not supported (the engine adapts the "
                         "linears of the decoder layers only, not embeddings or lm_head)")
    if config.get("modules_to_save"):
        raise ValueError(f"{path}: modules_to_save={config['modules_to_save']!r} is not supported (whole "
                         "trained copies of modules; only LoRA A/B pairs are)")
    for key in ("r", "lora_alpha"):
        value = config.get(key, 8)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{path}: {key} must be a positive number, got {value!r}")
    config["_path"] = path
    return config


def _refused_names(value: object) -> list[str]:
    names = [value] if isinstance(value, str) else list(value or ())
    return [n for n in names if any(r in str(n) for r in REFUSED_TARGETS)]


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path, device="cpu")
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file becomes the user's error, naming it
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def _pair_weights(tensors: Mapping[str, torch.Tensor], path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module name: (lora_A, lora_B)}`` from PEFT's keys; refuses what the engine cannot apply."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        match = re.fullmatch(r"(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", name)
        if match is None:
            what = "embedding adapters" if "lora_embedding" in key else "DoRA" if "magnitude" in key else "weights"
            raise ValueError(f"{path}: {key!r}: {what} of this kind are not supported (only lora_A/lora_B of linears)")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise ValueError(f"{path}: {key!r} is not a floating-point tensor")
        halves.setdefault(match.group(1), {})[match.group(2)] = tensor
    pairs = {}
    for name, half in halves.items():
        if set(half) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(half)).pop()
            raise ValueError(f"{path}: {name} has no {missing} weight")
        pairs[name] = (half["lora_A"], half["lora_B"])
    return pairs


def _resolve(name: str, targets: Mapping[str, tuple[int, int]], path: str) -> str:
    if any(r in name.split(".")[-1] for r in REFUSED_TARGETS):
        raise ValueError(f"{path}: {name}: adapters of embeddings and lm_head are not supported")
    if name in targets:
        return name
    # an adapter made on the inner decoder model (no ``model.`` in front) still names the same linears
    for candidate in (f"model.{name}", name.removeprefix("model.")):
        if candidate in targets:
            return candidate
    raise ValueError(f"{path}: {name} is not a linear layer of the base model (target module not present)")


def _scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA; per-module patterns win."""
    alpha = config.get("lora_alpha", 8)
    pattern = _pattern_value(config.get("alpha_pattern") or {}, module)
    if pattern is not None:
        alpha = pattern
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _pattern_value(patterns: Mapping[str, object], module: str) -> object | None:
    for key, value in patterns.items():  # PEFT's rule: the key matches a dotted suffix of the module name
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None
