"""A fused CPU forward for the decoder layers of Llama-family models (Llama, Mistral, Qwen2; SmolLM is Llama).

transformers' decoder layer runs ~50 small torch ops per layer (RMSNorm alone is seven: cast, pow, mean,
add, rsqrt, mul, mul), each with its Python dispatch; at the row counts of a CPU decode step that costs as
a good share of a CPU decode step. Inside an engine forward, on CPU, this forward does the same math in a
dozen calls: fused RMSNorm, the three projections, rotary embedding of q and k in place, paged attention
straight on ``[tokens, heads, dim]`` (no transposes), the output projection, residual add + RMSNorm in one
pass, gate and up projections, SiLU and the product in place, the down projection and the last residual
add. The fused kernels live in ``cpu/csrc/fused_cpu.c`` and round like the torch code they replace.
Measured on the default model (fp32, AVX2 host, steps alternating fused/unfused in one engine): decode steps
7% faster at 64 sequences, 12% at one. Where the engine packs its linears, q/k/v run as one packed GEMM and
gate/up as another (``PackedLinears.group``): another ~5% per decode step at 64 sequences, ~7% at one (Zen 4).

Only layers whose classes and structure are known exactly are patched (transformers' own classes of the
families below, by identity: a subclass or a remote-code copy of the same name may change the math; the four
children, plain ``nn.Linear`` (or weight-only quantized :class:`~hf_paged.model.layers.quant_linear.QuantLinear`, called as
modules) projections, SiLU activation, full-width "rotate half" rotary); every other
call (outside the engine, GPU, autograd, a static-shape step, a rotary table of another width) runs the
original forward. The patch belongs to the model (reference-counted, shared by its engines): while any engine
holds it, every engine forward on CPU takes it.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
import weakref

import torch

from hf_paged.attention import function as attention
from hf_paged.model import patches as model_patches
from hf_paged.kernels.cpu import fused_ops
from hf_paged.model.layers.quant_linear import QuantLinear
from hf_paged.model.layers.linear import DenseLinear
from hf_paged.model.layers.parallel import linear_of

logger = logging.getLogger(__name__)

FAMILIES = ("Llama", "Mistral", "Qwen2")
ROLES = ("DecoderLayer", "Attention", "MLP", "RMSNorm", "Model", "ForCausalLM")
QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTN_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}


_FAMILY_CLASSES: dict[str, dict[str, type]] = {}


def family_classes() -> dict[str, dict[str, type]]:
    """transformers' own classes by role of each family whose modeling module is imported, e.g. ``["Llama"]["MLP"]
    is modeling_llama.LlamaMLP``. A family whose module is not imported has no objects to recognise (an instance
    of a class means its module ran), so none is imported here: importing Mistral's and Qwen2's modules for a
    Llama model took ~70 ms of every start."""
    for family in FAMILIES:
        if family not in _FAMILY_CLASSES:
            module = sys.modules.get(f"transformers.models.{family.lower()}.modeling_{family.lower()}")
            if module is not None and all(hasattr(module, family + role) for role in ROLES):
                _FAMILY_CLASSES[family] = {role: getattr(module, family + role) for role in ROLES}
    return _FAMILY_CLASSES


@functools.cache
def silu_classes() -> tuple[type, ...]:
    """The SiLU activations transformers' ``ACT2FN`` gives these families ("silu", "swish")."""
    from transformers.activations import SiLUActivation

    return (SiLUActivation, torch.nn.SiLU)


def family_of(module: torch.nn.Module, role: str) -> str | None:
    """The family whose transformers class for ``role`` is exactly ``type(module)``; None for any other class,
    a subclass or a same-named copy (remote code) included: those may change the math."""
    return next((f for f, classes in family_classes().items() if type(module) is classes[role]), None)


def not_family(module: torch.nn.Module, role: str) -> str:
    """The reason ``module`` is no family's ``role`` class (for :func:`family_of` returning None)."""
    cls = type(module)
    names = [f"{f}{role}" for f in FAMILIES]
    if cls.__name__ in names:
        return f"{cls.__module__}.{cls.__qualname__} is not transformers' {cls.__name__} (a subclass or a copy)"
    return f"{cls.__name__} is not one of " + ", ".join(names)


def _class_name(cls: type) -> str:
    own = cls.__module__.startswith(("transformers.", "torch."))
    return cls.__name__ if own else f"{cls.__module__}.{cls.__qualname__}"


def _why_not(layer: torch.nn.Module) -> str:
    """Why ``layer`` cannot take the fused forward ("" if it can)."""
    family = family_of(layer, "DecoderLayer")
    if family is None:
        return not_family(layer, "DecoderLayer")
    classes = family_classes()[family]
    if "forward" in layer.__dict__:
        return "its forward is already replaced"
    children = dict(layer.named_children())
    if set(children) != _LAYER_CHILDREN:
        return f"children {sorted(children)}, expected {sorted(_LAYER_CHILDREN)}"
    attn, mlp = children["self_attn"], children["mlp"]
    expected = {
        "self_attn": "Attention", "mlp": "MLP", "input_layernorm": "RMSNorm", "post_attention_layernorm": "RMSNorm",
    }
    for child, role in expected.items():
        if type(children[child]) is not classes[role]:
            return f"{child} is {_class_name(type(children[child]))}, expected transformers' {family}{role}"
    if set(dict(attn.named_children())) != _ATTN_CHILDREN or set(dict(mlp.named_children())) != _MLP_CHILDREN:
        return "unexpected attention or MLP submodules"
    # o_proj and down_proj of a tensor-parallel shard are ParallelLinears (the fused forward calls them as
    # modules, so their all-reduce runs); the projections it groups into one GEMM must be plain
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj,
               linear_of(attn.o_proj), linear_of(mlp.down_proj)]
    if any(type(m) not in (torch.nn.Linear, DenseLinear, QuantLinear) for m in linears):
        return "a projection is not a plain nn.Linear or one of the engine's linear layers"
    if type(mlp.act_fn) not in silu_classes():
        return f"MLP activation {_class_name(type(mlp.act_fn))}, expected SiLU"
    for attr in ("head_dim", "scaling", "layer_idx"):
        if getattr(attn, attr, None) is None:
            return f"attention has no {attr}"
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if getattr(norm, "variance_epsilon", None) is None or getattr(norm, "weight", None) is None:
            return "an RMSNorm without weight or variance_epsilon"
    return ""


class FusedLayers:
    """Puts a fused decoder layer object in place of every eligible decoder layer of ``model`` (undone by
    :meth:`remove`).

    The fused layer is a new object of a subclass of the layer's own transformers class (:func:`fused_class`)
    sharing the original's parameter and submodule dicts, so ``state_dict`` keys and every child stay as they
    are; :meth:`remove` puts the original objects back.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers: list[torch.nn.Module] = []
        self._swapped: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]] = []
        skipped: dict[str, int] = {}
        layer_classes = tuple(classes["DecoderLayer"] for classes in family_classes().values())
        model_ref = weakref.ref(model)
        for parent in list(model.modules()):
            for name, module in list(parent.named_children()):
                # candidates: the families' layers and their subclasses; other "...DecoderLayer"s (remote-code
                # copies, other families) only for the log. _why_not decides by class identity.
                if not isinstance(module, layer_classes) and not type(module).__name__.endswith("DecoderLayer"):
                    continue
                why = _why_not(module)
                if why:
                    skipped[why] = skipped.get(why, 0) + 1
                    continue
                fused = copy.copy(module)  # a new object whose __dict__ holds the same parameter and module dicts
                fused.__class__ = fused_class(type(module))
                fused._hfp_model = model_ref
                setattr(parent, name, fused)
                self._swapped.append((parent, name, module, fused))
                self.layers.append(fused)
        if self.layers or skipped:
            logger.info("fused CPU forward on %d decoder layers%s", len(self.layers),
                        "".join(f"; {n} not ({why})" for why, n in skipped.items()))

    def __len__(self) -> int:
        return len(self.layers)

    def remove(self) -> None:
        """Put the original decoder layers back (where the fused one is still in place)."""
        for parent, name, original, fused in reversed(self._swapped):
            if parent._modules.get(name) is fused:
                setattr(parent, name, original)
        self._swapped.clear()
        self.layers.clear()


@functools.cache
def fused_class(cls: type) -> type:
    """The fused layer class of transformers' decoder layer class ``cls``: ``cls`` with the fused forward."""
    return type(f"Fused{cls.__name__}", (cls,), {
        "__module__": __name__, "forward": _fused_forward, "_stock_forward": cls.forward,
        "__doc__": f"{cls.__name__} with hf_paged's fused CPU forward inside engine forwards (cpu/fused_layers.py).",
    })


def _group(model_ref, parent: torch.nn.Module, names: tuple[str, ...], x: torch.Tensor):
    """The engine's packed group of ``parent``'s linears ``names`` (one GEMM for them), if it can take ``x``."""
    model = model_ref()
    packing = None if model is None else model_patches.current(model, "packing")
    group = None if packing is None or torch.is_grad_enabled() else packing.group(parent, names)
    return group if group is not None and group.dtype == x.dtype else None


def _with_slots(x: torch.Tensor, outs, modules) -> tuple:
    """A packed group's member outputs, each through its layer's LoRA slot where one is set."""
    return tuple(y if m.lora is None else m.lora(x, y) for y, m in zip(outs, modules))


def _fused_forward(layer, hidden_states, *args, **kwargs):
    """The fused decoder layer's forward (transformers calls layers by keyword; pass on what it gives)."""
    meta = kwargs.get(attention.METADATA_KWARG)
    position_embeddings = kwargs.get("position_embeddings")
    ln1 = layer.input_layernorm
    attn, mlp = layer.self_attn, layer.mlp
    if (
        args or not isinstance(meta, attention.AttentionMetadata) or torch.compiler.is_compiling()
        or position_embeddings is None or hidden_states.dim() != 3 or hidden_states.shape[0] != 1
        or hidden_states.device.type != "cpu" or hidden_states.dtype != ln1.weight.dtype
        or (torch.is_grad_enabled() and hidden_states.requires_grad)
        or position_embeddings[0].shape[-1] != attn.head_dim or position_embeddings[0].dtype != hidden_states.dtype
    ):
        return layer._stock_forward(hidden_states, *args, **kwargs)
    head_dim = attn.head_dim
    x = hidden_states[0]
    tokens = x.shape[0]
    h, _ = fused_ops.rms_norm(x, ln1.weight, ln1.variance_epsilon)
    qkv = _group(layer._hfp_model, attn, QKV, h)
    if qkv is not None:  # one GEMM, q/k/v as column views of its output (then each member's LoRA slot)
        q, k, v = _with_slots(h, qkv.linear(h).split_with_sizes(qkv.sizes, dim=-1), qkv.modules)
    else:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    cos, sin = position_embeddings
    fused_ops.rope_(q, k, cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim))
    # the engine's attention layer object: its pool, backend and settings (scaling, window) learned at start
    out = meta.layers[attn.layer_idx](
        q.view(tokens, -1, head_dim), k.view(tokens, -1, head_dim), v.view(tokens, -1, head_dim), meta)
    o = attn.o_proj(out.reshape(tokens, -1))
    ln2 = layer.post_attention_layernorm
    h, residual = fused_ops.rms_norm(o, ln2.weight, ln2.variance_epsilon, residual=x)
    gate_up = _group(layer._hfp_model, mlp, GATE_UP, h)
    if gate_up is not None:
        gate, up = _with_slots(h, gate_up.linear(h).split_with_sizes(gate_up.sizes, dim=-1), gate_up.modules)
        # in place in the GEMM's output: the same two roundings as mul(silu(gate), up), no new tensor
        m = mlp.down_proj(fused_ops.silu_mul_(gate, up))
    else:
        m = mlp.down_proj(fused_ops.silu_mul_(mlp.gate_proj(h), mlp.up_proj(h)))
    return torch.add(residual, m).unsqueeze(0)
