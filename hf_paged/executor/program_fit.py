"""Which models the native decode program (:mod:`hf_paged.executor.native_program`) can run, and which of their
modules it skips (whose forward hooks the eager fused forward would run)."""

from __future__ import annotations

import torch

from hf_paged.model.layers.fused_decoder import family_classes, family_of, not_family
from hf_paged.model.layers.quant_linear import QuantEmbedding, QuantLinear, kernel
from hf_paged.model.layers.linear import DenseLinear
from hf_paged.model.layers.parallel import linear_of

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the C kernels' dtype codes


def why_not(model: torch.nn.Module, fused, packing) -> str:
    """Why ``model`` cannot run as a :class:`DecodeProgram` ("" if it can). Classes are matched by identity with
    transformers' own (a subclass or a same-named copy may change the math)."""
    family = family_of(model, "ForCausalLM")
    if family is None:
        return not_family(model, "ForCausalLM")
    classes = family_classes()[family]
    base = getattr(model, "model", None)
    if type(base) is not classes["Model"]:
        cls = type(base)
        return f"model.model is {cls.__module__}.{cls.__qualname__}, expected transformers' {family}Model"
    quantized = _quantized_linears(model)
    if fused is None or (packing is None and not quantized):
        return "it needs the fused layers and packed (or quantized) linears"
    layers = list(getattr(base, "layers", ()))
    if not layers or any(layer not in fused.layers for layer in layers):
        return "not every decoder layer has the fused forward"
    if type(base.embed_tokens) not in (torch.nn.Embedding, QuantEmbedding) or (
        type(linear_of(model.lm_head)) not in (torch.nn.Linear, DenseLinear, QuantLinear)  # (a TP head: its slice)
    ):
        return "the embedding or the LM head is not a plain (or quantized) nn.Embedding / nn.Linear"
    if type(base.norm) is not classes["RMSNorm"] or getattr(base.norm, "variance_epsilon", None) is None:
        norm = type(base.norm)
        return f"the final norm is {norm.__module__}.{norm.__qualname__}, expected transformers' {family}RMSNorm"
    if getattr(base, "rotary_emb", None) is None:
        return "the model has no rotary_emb"
    embed = base.embed_tokens
    dtype = embed.dtype if type(embed) is QuantEmbedding else embed.weight.dtype
    if quantized and dtype != torch.float32 and not (dtype == torch.bfloat16 and _bf16_mode(model)):
        return ("quantized linears run in the program with fp32 activations, or with bf16 ones in the bf16 kernel "
                "mode (quant_activations='bf16', AMX-BF16) only")
    if dtype not in DTYPES or (not quantized and packing.kinds.get(dtype, "torch") == "torch"):
        return f"its {str(dtype).removeprefix('torch.')} linears are not packed here (prepack_weights)"
    if any(p.dtype != dtype or p.device.type != "cpu" for p in model.parameters()):
        return "its parameters are not all CPU tensors of one dtype"
    return ""


def _quantized_linears(model: torch.nn.Module) -> bool:
    return any(type(m) is QuantLinear for m in model.modules())


def _bf16_mode(model: torch.nn.Module) -> bool:
    """Every quantized linear in the bf16 kernel mode, and that mode's kernel running here (it takes bf16 in and out)."""
    return all(m.activations == "bf16" for m in model.modules() if type(m) is QuantLinear) and kernel("bf16")[1] == "bf16"


def skipped_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules the eager fused forward calls (running their hooks) and the program does not call: the model
    and its base, the embedding, the final norm (a C pass where it gives the module's bits), the LM head, the
    decoder layers and their o/down projections. (The rotary embedding the program calls; the fused forward calls
    none of the others.)"""
    base = model.model
    layers = list(base.layers)
    return [model, base, base.embed_tokens, base.norm, model.lm_head, *layers,
            *(layer.self_attn.o_proj for layer in layers), *(layer.mlp.down_proj for layer in layers)]


def hooks(modules: list[torch.nn.Module]) -> str:
    """A reason if one of ``modules`` (or every module: global hooks) has forward hooks the program would skip."""
    m = torch.nn.modules.module
    if m._global_forward_hooks or m._global_forward_pre_hooks:
        return "global module forward hooks are registered"
    for module in modules:
        if module._forward_hooks or module._forward_pre_hooks:
            return f"a {type(module).__name__} module has forward hooks"
    return ""
