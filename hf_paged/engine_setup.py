"""The engine's intake helpers: prompts to validated token ids, prompt lists, stop tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_ids(prompt, tokenizer, vocab_size: int) -> tuple[list[int], str | None]:
    """A prompt's token ids (and its text when given as text), validated against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"a text prompt ({prompt[:40]!r}) needs a tokenizer: pass tokenizer= to the engine, or token ids")
        ids = tokenizer(prompt)["input_ids"]
        text: str | None = prompt
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point() or prompt.dtype == torch.bool:
            raise TypeError(f"a tensor prompt must be 1-D integer token ids, got {prompt.dtype} {tuple(prompt.shape)}")
        ids, text = prompt.tolist(), None
    elif isinstance(prompt, Sequence):
        ids, text = list(prompt), None
    elif hasattr(prompt, "__array__") and getattr(prompt, "ndim", None) == 1:  # a numpy array of token ids
        if getattr(prompt.dtype, "kind", "i") not in "iu":
            raise TypeError(f"an array prompt must hold integer token ids, got dtype {prompt.dtype}")
        ids, text = prompt.tolist(), None
    else:
        raise TypeError(f"prompt must be a str, a list of token ids or a 1-D tensor, got {type(prompt).__name__}")
    if not ids:
        raise ValueError(f"prompt {prompt!r} is empty (no tokens)")
    out = []
    for tok in ids:
        if isinstance(tok, bool) or not hasattr(tok, "__index__"):
            raise TypeError(f"token ids must be ints, got {tok!r} ({type(tok).__name__})")
        if isinstance(tok, torch.Tensor) and tok.dim() != 0:
            raise TypeError(f"token ids must be ints, got a tensor of shape {tuple(tok.shape)}")
        tok = int(tok)  # numpy and torch integers too
        if not 0 <= tok < vocab_size:
            raise ValueError(f"token id {tok} is outside the vocabulary [0, {vocab_size})")
        out.append(tok)
    return out, text


def eos_token_ids(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    eos = None
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None:
        eos = gen_cfg.eos_token_id
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, torch.Tensor)):
        return [prompts]
    if isinstance(prompts, Sequence):
        if not prompts:
            raise ValueError("prompts is empty")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            return [list(prompts)]  # one prompt of token ids
        return list(prompts)
    raise TypeError(f"prompts must be a str, a list of str, or token ids, got {type(prompts).__name__}")


def per_prompt(value, n: int, what: str) -> list:
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise ValueError(f"got {len(value)} {what} for {n} prompts")
        return list(value)
    return [value] * n
