"""``wrap``/``unwrap``: the same model object, with ``model.paged`` and an engine-backed ``generate``."""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass

import torch

from hf_paged.engine.generator import PagedGenerator
from hf_paged.hf.generate import paged_generate
from hf_paged.hf.peft_adapters import STATE_KEY, PeftAdapters, export_adapters, is_peft_model

_STATE = STATE_KEY


@dataclass
class _WrapState:
    engine: PagedGenerator
    own_generate: object  # an instance-level ``generate`` the model had before wrap, or None
    adapters: PeftAdapters | None = None  # a PEFT model's LoRA adapters, served by the engine


def is_wrapped(model: torch.nn.Module) -> bool:
    return _STATE in model.__dict__


def wrap(model: torch.nn.Module, tokenizer=None, **engine_config) -> torch.nn.Module:
    """Serve ``model`` through a paged engine, in place.

    Registers the "hf_paged" attention implementation, attaches ``model.paged`` (a
    :class:`~hf_paged.PagedGenerator` sharing the model's weights) and replaces ``model.generate`` with an
    HF-compatible method that runs all rows as one continuous batch. A plain forward is unchanged.

    A PEFT ``PeftModel`` with LoRA adapters is served with them: ``generate`` runs the active adapter (none
    while PEFT's adapters are disabled), or each row's adapter from PEFT's ``adapter_names=[...]``
    (``"__base__"``: the base model), all rows in one batch (docs/lora.md).

    Args:
        model: A ``transformers`` causal LM, or a PEFT model of one.
        tokenizer: Optional; enables text prompts in ``model.paged`` and ``stop_strings``.
        **engine_config: :class:`~hf_paged.EngineConfig` fields (``num_blocks``, ``max_num_seqs``, ...).

    Returns:
        The same ``model`` object. Wrapping an already wrapped model warns and changes nothing.
    """
    if is_wrapped(model):
        warnings.warn("hf_paged.wrap: this model is already wrapped; nothing changed", stacklevel=2)
        return model
    adapters = None
    target = model
    if is_peft_model(model):  # its LoRA adapters run in the engine's slots, per row (hf_paged/hf/peft_adapters.py)
        adapters = export_adapters(model)
        target = model.get_base_model()
        engine_config = {"enable_lora": True, "max_loras": max(1, min(len(adapters.requests), 4)),
                         "max_lora_rank": max(16, adapters.max_rank), **engine_config}
    try:
        engine = PagedGenerator(target, tokenizer, **engine_config)
        for request in adapters.requests.values() if adapters is not None else ():
            engine.add_lora(request)
    except BaseException:
        if adapters is not None:
            if "engine" in locals():
                engine.close()
            adapters.close()
        raise
    from hf_paged.hf import pipeline_patch  # transformers.pipelines costs ~4 s to import: only once a model is wrapped

    pipeline_patch.install(is_wrapped)
    model.__dict__[_STATE] = _WrapState(engine, model.__dict__.get("generate"), adapters)
    model.__dict__["paged"] = engine
    model.__dict__["generate"] = types.MethodType(paged_generate, model)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`wrap`: stock ``generate``, the original attention implementation, no ``model.paged``."""
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        warnings.warn("hf_paged.unwrap: this model is not wrapped; nothing changed", stacklevel=2)
        return model
    state.engine.close()
    if state.adapters is not None:
        state.adapters.close()
    from hf_paged.hf import pipeline_patch

    pipeline_patch.uninstall()
    model.__dict__.pop("paged", None)
    if state.own_generate is not None:
        model.__dict__["generate"] = state.own_generate
    else:
        model.__dict__.pop("generate", None)
    return model

