"""``wrap``/``unwrap``: the same model object, with ``model.paged`` and an engine-backed ``generate``."""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass

import torch

from hf_paged.engine.generator import PagedGenerator
from hf_paged.hf.generate import paged_generate

_STATE = "_hf_paged_state"


@dataclass
class _WrapState:
    engine: PagedGenerator
    own_generate: object  # an instance-level ``generate`` the model had before wrap, or None


def is_wrapped(model: torch.nn.Module) -> bool:
    return _STATE in model.__dict__


def wrap(model: torch.nn.Module, tokenizer=None, **engine_config) -> torch.nn.Module:
    """Serve ``model`` through a paged engine, in place.

    Registers the "hf_paged" attention implementation, attaches ``model.paged`` (a
    :class:`~hf_paged.PagedGenerator` sharing the model's weights) and replaces ``model.generate`` with an
    HF-compatible method that runs all rows as one continuous batch. A plain forward is unchanged.

    Args:
        model: A ``transformers`` causal LM.
        tokenizer: Optional; enables text prompts in ``model.paged`` and ``stop_strings``.
        **engine_config: :class:`~hf_paged.EngineConfig` fields (``num_blocks``, ``max_num_seqs``, ...).

    Returns:
        The same ``model`` object. Wrapping an already wrapped model warns and changes nothing.
    """
    if is_wrapped(model):
        warnings.warn("hf_paged.wrap: this model is already wrapped; nothing changed", stacklevel=2)
        return model
    engine = PagedGenerator(model, tokenizer, **engine_config)
    from hf_paged.hf import pipeline_patch  # transformers.pipelines costs ~4 s to import: only once a model is wrapped

    pipeline_patch.install(is_wrapped)
    model.__dict__[_STATE] = _WrapState(engine, model.__dict__.get("generate"))
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
    from hf_paged.hf import pipeline_patch

    pipeline_patch.uninstall()
    model.__dict__.pop("paged", None)
    if state.own_generate is not None:
        model.__dict__["generate"] = state.own_generate
    else:
        model.__dict__.pop("generate", None)
    return model
