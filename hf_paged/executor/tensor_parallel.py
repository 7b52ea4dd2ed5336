"""Tensor-parallel sharding of a HF causal LM: which linears are split how, and the one rank's shard.

The plan is the model's own ``base_model_tp_plan`` from its transformers config where it has one ("colwise" /
"rowwise" per module pattern), and our default otherwise (q/k/v and gate/up by output, o and down by input). The
sharding itself is ours, on plain tensors:

- colwise: rank ``r`` keeps its slice of the output rows (and bias). q/k/v are split by whole heads
  (:func:`head_split`): each rank keeps a run of KV heads and the query heads that read them, unevenly where
  ``N`` does not divide the KV heads (the default model's 3 KV heads over 2 ranks: 1 + 2); with ``N`` a multiple
  of the KV heads, each KV head is replicated on ``N/KV`` ranks (as vLLM does).
- rowwise: rank ``r`` keeps its slice of the input columns; the partial outputs are summed over ranks by an
  all-reduce that is part of the layer (:class:`~hf_paged.model.layers.parallel.ParallelLinear`); a bias is added
  by rank 0 only.
- the LM head is split by vocabulary rows; rank 0 gathers the rows' logits (sampling happens once, there), again
  in the layer.
- everything else (embeddings, norms, rotary) is replicated.

Each rank's attention modules see only their heads, so the KV pool a rank builds holds only its KV heads.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field

import torch

from hf_paged.kernels.cpu.quant_formats import BLOCK_BYTES, GROUP
from hf_paged.model.layers.quant_linear import QuantLinear
from hf_paged.model.hf_config import text_config
from hf_paged.model.layers.parallel import COMM, CommStats, ParallelLinear  # noqa: F401 - COMM re-exported

# the default plan for models whose config carries none (relative to the base model)
DEFAULT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}
SUPPORTED_STYLES = ("colwise", "rowwise")
REPLICATED_STYLES = ("replicated_with_grad_allreduce",)  # e.g. q_norm/k_norm: the same on every rank
HEAD_ATTRS = ("num_heads", "num_attention_heads")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads")


@dataclass
class Shard:
    """What one rank holds: its rank, the world, and each attention module's local head counts."""

    rank: int
    world: int
    num_heads: int  # query heads of this rank
    num_kv_heads: int  # key/value heads of this rank
    vocab_rows: tuple[int, int]  # LM head rows [start, stop) this rank computes
    # parameter name -> (dim, start, stop) of the full tensor this rank keeps (the rest are whole); the LM
    # head's rows may end past the vocabulary: those are zeros
    slices: dict[str, tuple[int, int, int]]
    # module name -> "sum" (row-parallel) or "gather" (the LM head): the linears :func:`parallelize` completes
    reduce: dict[str, str] = field(default_factory=dict)
    vocab: int = 0  # the full vocabulary (the LM head's rows before the split)
    # sharded linear's module name -> (dim, start, stop, full): the output rows (dim 0, colwise) or input columns
    # (dim 1, rowwise) [start, stop) this rank keeps of the full layer's ``full`` (a LoRA adapter is cut the same way)
    linear_parts: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)


def tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """``{module name regex: style}`` over the full model's module names."""
    plan = getattr(text_config(model), "base_model_tp_plan", None) or DEFAULT_PLAN
    prefix = getattr(model, "base_model_prefix", "model")
    out = {}
    for key, style in plan.items():
        pattern = re.escape(f"{prefix}.{key}").replace(r"\*", r"\d+")
        out[pattern] = style
    return out


def head_split(heads: int, kv: int, world: int) -> list[tuple[int, int, int, int]]:
    """Per rank: its query heads ``[q0, q1)`` and KV heads ``[k0, k1)``. Query heads follow the KV head they
    read. With at most as many ranks as KV heads, the KV heads are split as evenly as they go (unevenly when the
    count does not divide: 9 query / 3 KV heads over 2 ranks gives 3 + 6 query heads); with more ranks, each KV
    head is replicated on ``world / kv`` ranks, which split its query heads."""
    if heads % kv:
        raise ValueError(f"{heads} attention heads do not group over {kv} key/value heads")
    group = heads // kv
    if world <= kv:
        out = []
        for rank in range(world):
            k0, k1 = rank * kv // world, (rank + 1) * kv // world
            out.append((k0 * group, k1 * group, k0, k1))
        return out
    if world % kv or group % (world // kv):
        raise ValueError(
            f"tensor_parallel_size={world} is more than the model's {kv} key/value heads: it must be a multiple of "
            f"them whose share of each KV head divides its {group} query heads"
        )
    share = world // kv
    per = group // share
    return [(rank * per, (rank + 1) * per, rank // share, rank // share + 1) for rank in range(world)]


def check_shardable(model: torch.nn.Module, world: int) -> tuple[int, int]:
    """(query heads, KV heads) of ``model``, or ValueError/NotImplementedError naming why it cannot be split ``world`` ways."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {world!r}")
    cfg = text_config(model)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if not isinstance(heads, int):
        raise NotImplementedError(f"{type(model).__name__}: no num_attention_heads in its config; cannot split its heads")
    head_split(heads, kv, world)
    plan = tp_plan(model)
    names = {name for name, _ in model.named_modules()}
    matched = {p: [n for n in names if re.fullmatch(p, n)] for p in plan}
    for pattern, style in plan.items():
        if style not in SUPPORTED_STYLES + REPLICATED_STYLES:
            raise NotImplementedError(
                f"{type(model).__name__}: its tp_plan shards {pattern!r} as {style!r}; hf_paged runs "
                f"{', '.join(SUPPORTED_STYLES)} (and replicated) layers"
            )
        for name in matched[pattern]:
            if style in SUPPORTED_STYLES and type(model.get_submodule(name)) not in (torch.nn.Linear, QuantLinear):
                raise NotImplementedError(
                    f"{type(model).__name__}: {name} is a {type(model.get_submodule(name)).__name__}, "
                    "hf_paged shards nn.Linear (and its quantized QuantLinear) layers only"
                )
    if not any(matched[p] for p, s in plan.items() if s == "rowwise"):
        raise NotImplementedError(
            f"{type(model).__name__}: no module matches its tensor-parallel plan ({sorted(plan.values())}); "
            "hf_paged shards models with separate q/k/v/o and gate/up/down projections"
        )
    return heads, kv


def _slice_param(module: torch.nn.Module, name: str, dim: int, start: int, stop: int, slices: dict, prefix: str) -> None:
    param = getattr(module, name)
    if param is None:
        return
    part = param.detach().narrow(dim, start, stop - start).clone()
    if name in module._buffers:  # a quantized layer's bytes and scales
        module._buffers[name] = part
    else:
        setattr(module, name, torch.nn.Parameter(part, requires_grad=False))
    slices[f"{prefix}.{name}"] = (dim, start, stop)


def _slice_linear(module: torch.nn.Module, name: str, style: str, start: int, stop: int, rank: int,
                  slices: dict, parts: dict) -> None:
    """Keep rank ``rank``'s part of one linear: output rows ``[start, stop)`` (colwise) or input columns (rowwise;
    the bias on rank 0 only). A quantized linear keeps the same rows of its bytes, or the bytes of the blocks of
    those columns (which must fall on its blocks of 32); its int8 row scales stay whole (the full row's)."""
    quantized = type(module) is QuantLinear
    if style == "colwise":
        parts[name] = (0, start, stop, module.out_features)
        for leaf in ("qweight", "scales", "bias") if quantized else ("weight", "bias"):
            _slice_param(module, leaf, 0, start, stop, slices, name)
        module.out_features = stop - start
        return
    parts[name] = (1, start, stop, module.in_features)
    if quantized:
        if start % GROUP or stop % GROUP:
            raise NotImplementedError(
                f"{name}: this rank's input columns [{start}, {stop}) do not fall on the {module.fmt} blocks of {GROUP}; "
                "shard the float model (quantization= at start quantizes each rank's slice)")
        per = BLOCK_BYTES[module.fmt]
        _slice_param(module, "qweight", 1, start // GROUP * per, stop // GROUP * per, slices, name)
    else:
        _slice_param(module, "weight", 1, start, stop, slices, name)
    if rank != 0 and module.bias is not None:
        module.bias = None  # added once, by rank 0, before the sum
    module.in_features = stop - start


def _rows(t: torch.Tensor | None, start: int, stop: int, rows: int) -> torch.Tensor | None:
    """Rows ``[start, stop)`` of ``t`` padded with zero rows to ``rows`` (a copy); the same-shaped empty tensor
    for a meta ``t`` (the shard is filled later)."""
    if t is None:
        return None
    if t.is_meta:
        return t.new_empty(rows, *t.shape[1:])
    part = t.detach()[start:stop]
    pad = rows - (stop - start)
    return torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part.clone()


def _vocab_slice(head: torch.nn.Module, rank: int, world: int) -> tuple[torch.nn.Module, int, int]:
    """The LM head's rows of ``rank`` as a plain ``nn.Linear`` (or a ``QuantLinear`` of the same format): every
    rank gets ``ceil(vocab / world)`` rows, the last one padded with zeros (zero bytes: zero logits in every
    format), and the rows' ``[start, stop)`` in the vocabulary. Empty (meta) where the head is."""
    vocab = head.out_features
    rows = -(-vocab // world)
    start, stop = min(rank * rows, vocab), min((rank + 1) * rows, vocab)
    bias = _rows(head.bias, start, stop, rows)
    if type(head) is QuantLinear:
        sliced = QuantLinear(head.in_features, rows, head.fmt, _rows(head.qweight, start, stop, rows),
                             _rows(head.scales, start, stop, rows), activations=head.activations)
        if bias is not None:  # (QuantLinear takes a bias as fp32; keep the meta one as it is)
            sliced.bias = torch.nn.Parameter(bias, requires_grad=False)
        return sliced, start, stop
    sliced = torch.nn.Linear(head.in_features, rows, bias=bias is not None, device="meta")
    sliced.weight = torch.nn.Parameter(_rows(head.weight, start, stop, rows), requires_grad=False)
    if bias is not None:
        sliced.bias = torch.nn.Parameter(bias, requires_grad=False)
    return sliced, start, stop


def shard_model(model: torch.nn.Module, rank: int, world: int) -> Shard:
    """Split ``model`` in place into rank ``rank``'s shard of ``world`` (new, smaller parameters: tensors it
    shared with another model are never written). The forward then needs the process group (all-reduce)."""
    heads, kv = check_shardable(model, world)
    q0, q1, k0, k1 = head_split(heads, kv, world)[rank]
    plan = tp_plan(model)
    slices: dict[str, tuple[int, int, int]] = {}
    parts: dict[str, tuple[int, int, int, int]] = {}
    reduce: dict[str, str] = {}
    head_dim = None
    attention_modules = set()
    for name, module in list(model.named_modules()):
        style = next((s for p, s in plan.items() if re.fullmatch(p, name)), None)
        if style not in SUPPORTED_STYLES:
            continue
        leaf = name.rsplit(".", 1)[-1]
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        if leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
            attention_modules.add(parent)
            n_heads = heads if leaf in ("q_proj", "o_proj") else kv
            size = module.in_features if leaf == "o_proj" else module.out_features
            if size % n_heads:
                raise NotImplementedError(f"{name}: {size} features do not split into {n_heads} heads")
            hd = size // n_heads
            h0, h1 = (q0, q1) if leaf in ("q_proj", "o_proj") else (k0, k1)
            start, stop = h0 * hd, h1 * hd
            if leaf == "q_proj":
                head_dim = hd
        else:
            size = module.out_features if style == "colwise" else module.in_features
            start, stop = rank * size // world, (rank + 1) * size // world
        _slice_linear(module, name, style, start, stop, rank, slices, parts)
        if style == "rowwise":
            reduce[name] = "sum"
    for module in attention_modules:
        for attr in HEAD_ATTRS:
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, q1 - q0)
        for attr in KV_HEAD_ATTRS:
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, k1 - k0)
        if isinstance(getattr(module, "num_key_value_groups", None), int):
            module.num_key_value_groups = (q1 - q0) // (k1 - k0)
        for norm in ("q_norm", "k_norm"):  # per-head norms are replicated; a norm over all heads cannot be split
            weight = getattr(getattr(module, norm, None), "weight", None)
            if weight is not None and head_dim is not None and weight.shape[-1] != head_dim:
                raise NotImplementedError(f"{type(module).__name__}.{norm} normalizes across heads; it cannot be split")
    head = model.get_output_embeddings()
    if type(head) not in (torch.nn.Linear, QuantLinear):
        raise NotImplementedError(f"{type(model).__name__}: its LM head is a {type(head).__name__}, not an nn.Linear")
    head_name = next(n for n, m in model.named_modules() if m is head)
    vocab = head.out_features
    sliced, start, stop = _vocab_slice(head, rank, world)
    model.set_output_embeddings(sliced)
    for leaf in ("qweight", "scales", "weight", "bias"):
        if getattr(sliced, leaf, None) is not None:
            slices[f"{head_name}.{leaf}"] = (0, start, start + sliced.out_features)
    reduce[head_name] = "gather"
    model.config.tie_word_embeddings = False  # never re-tie the slice to the full embedding
    text_config(model).tie_word_embeddings = False
    return Shard(rank, world, q1 - q0, k1 - k0, (start, stop), slices, reduce, vocab, parts)


def parallelize(model: torch.nn.Module, shard: Shard) -> torch.nn.Module:
    """Complete a filled shard (its weights read): every row-parallel linear and the LM head become a
    :class:`~hf_paged.model.layers.parallel.ParallelLinear` running its collective after its slice. Returns ``model``."""
    head = model.get_output_embeddings()
    for name, how in shard.reduce.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, leaf)
        full = shard.vocab if how == "gather" else None
        layer = ParallelLinear(base, how, shard.rank, shard.world, full)
        if base is head:
            model.set_output_embeddings(layer)
        else:
            setattr(parent, leaf, layer)
    _SHARDS[model] = shard
    return model


# a rank's model -> its Shard (the model is the rank's private object: kept as long as it lives)
_SHARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shard_of(model: torch.nn.Module) -> Shard | None:
    """The :class:`Shard` a tensor-parallel rank's ``model`` was cut to (:func:`parallelize`), or None."""
    return _SHARDS.get(model)
