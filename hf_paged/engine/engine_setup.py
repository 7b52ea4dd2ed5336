"""The engine's intake helpers: prompts to validated token ids, prompt lists, stop tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


_PROMPT_KINDS = "a str, a list of token ids, or a 1-D integer tensor or NumPy array"
_BYTES = (bytes, bytearray, memoryview)


def _bytes_error(what: str, value) -> TypeError:
    shown = bytes(value)[:40]
    return TypeError(
        f"{what} must be {_PROMPT_KINDS}, got {type(value).__name__} ({shown!r}): decode it to a str "
        "(text, tokenized by the engine's tokenizer) or pass token ids"
    )


def token_ids(prompt, tokenizer, vocab_size: int) -> tuple[list[int], str | None]:
    """A prompt's token ids (and its text when given as text), validated against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"a text prompt ({prompt[:40]!r}) needs a tokenizer: pass tokenizer= to the engine, or token ids")
        ids = tokenizer(prompt)["input_ids"]
        text: str | None = prompt
    elif isinstance(prompt, _BYTES):  # a Sequence of ints, but never meant as token ids
        raise _bytes_error("prompt", prompt)
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point() or prompt.dtype == torch.bool:
            raise TypeError(f"a tensor prompt must be 1-D integer token ids, got {prompt.dtype} {tuple(prompt.shape)}")
        ids, text = prompt.tolist(), None
    elif isinstance(prompt, np.ndarray):
        if prompt.ndim != 1:
            raise TypeError(f"an array prompt must be 1-D integer token ids, got {prompt.dtype} {tuple(prompt.shape)}")
        if prompt.dtype.kind not in "iu":
            raise TypeError(f"an array prompt must hold integer token ids, got dtype {prompt.dtype}")
        ids, text = prompt.tolist(), None
    elif isinstance(prompt, Sequence):
        ids, text = list(prompt), None
    else:
        raise TypeError(f"prompt must be {_PROMPT_KINDS}, got {type(prompt).__name__}")
    if not ids:
        raise ValueError(f"prompt {prompt!r} is empty (no tokens)")
    out = []
    for tok in ids:
        if isinstance(tok, (bool, np.bool_)) or not hasattr(tok, "__index__"):
            raise TypeError(f"token ids must be ints, got {tok!r} ({type(tok).__name__})")
        if isinstance(tok, torch.Tensor) and tok.dim() != 0:
            raise TypeError(f"token ids must be ints, got a tensor of shape {tuple(tok.shape)}")
        tok = int(tok)  # numpy and torch integers too
        if not 0 <= tok < vocab_size:
            raise ValueError(f"token id {tok} is outside the vocabulary [0, {vocab_size})")
        out.append(tok)
    return out, text


def token_id_list(value) -> list[int]:
    """A token-id setting (``eos_token_id`` and the like: None, one int, a list, or a tensor) as a list of ints."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def eos_token_ids(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    eos = None
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None:
        eos = gen_cfg.eos_token_id
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return frozenset(token_id_list(eos))


def _is_token_id(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_prompt_list(prompts) -> list:
    """Prompts as a list: a str, a 1-D tensor or NumPy array, or a list of token ids is one prompt; a list of
    those is several."""
    if isinstance(prompts, (str, torch.Tensor, np.ndarray)):
        return [prompts]  # a 2-D tensor or array is refused by token_ids, naming its shape
    if isinstance(prompts, _BYTES):
        raise _bytes_error("prompts", prompts)
    if isinstance(prompts, Sequence):
        if not prompts:
            raise ValueError("prompts is empty")
        if all(_is_token_id(p) for p in prompts):
            return [list(prompts)]  # one prompt of token ids
        return list(prompts)
    raise TypeError(f"prompts must be {_PROMPT_KINDS}, or a list of those, got {type(prompts).__name__}")


def per_prompt(value, n: int, what: str) -> list:
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise ValueError(f"got {len(value)} {what} for {n} prompts")
        return list(value)
    return [value] * n
