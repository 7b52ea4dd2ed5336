"""Building the execution layer's pieces from a model and an :class:`EngineConfig`: the KV pool, packed
linears, fused layers, the fast step runner, speculative proposers; and giving the model back."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from hf_paged.attention import function as attention
from hf_paged.model import patches as model_patches
from hf_paged.attention.layer import AttentionLayers
from hf_paged.config import EngineConfig
from hf_paged.kernels.cpu import attention as cpu_attention, fused_ops
from hf_paged.kernels.cpu import packed_linear
from hf_paged.model.layers.fused_decoder import FAMILIES, FusedLayers
from hf_paged.executor.native_program import DecodeProgram
from hf_paged.model.layers.packed import PackedLinears
from hf_paged.executor.program_fit import hooks, skipped_modules, why_not
from hf_paged.executor.tensor_parallel import shard_of
from hf_paged.model.layers.quant_linear import QuantLinear
from hf_paged.model.layers.quantize import QuantizedLinears
from hf_paged.lora.attach import adaptable_linears, attach_slots
from hf_paged.lora.manager import LoRAManager
from hf_paged.model.default_model import load_model
from hf_paged.model.layers.linear import OwnedLinears, is_dense
from hf_paged.executor.decode_buckets import DecodeBuckets, resolve_mode
from hf_paged.executor.input_batch import BlockTables
from hf_paged.executor.kv_pool import KVPool, decide_num_blocks, probe_kv_layout
from hf_paged.model.hf_config import chunked_attention_size, text_config
from hf_paged.executor.step_runners import decoder_layers

if TYPE_CHECKING:
    from hf_paged.spec_decode.eagle.proposer import EagleProposer

logger = logging.getLogger(__name__)


def build_pool(model: torch.nn.Module, cfg: EngineConfig, device: torch.device, agree=None) -> tuple[KVPool, int]:
    """The KV pool for ``model`` and the engine's ``max_model_len`` (``agree``: the ranks of a tensor-parallel
    group settle on one block count)."""
    if model.training:
        logger.warning("model is in training mode: dropout will make generation random; call model.eval()")
    specs = probe_kv_layout(model, cfg.kv_cache_dtype)
    model_max = max_positions(model)
    chunk = chunked_attention_size(model)
    if chunk is not None:  # exact only up to one attention chunk (Llama 4): cap the length there
        if cfg.max_model_len is not None and cfg.max_model_len > chunk:
            raise NotImplementedError(
                f"max_model_len={cfg.max_model_len} exceeds the attention chunk ({chunk} tokens) of "
                f"{type(model).__name__}; hf_paged has no chunked attention mask, so it serves at most one chunk"
            )
        model_max = min(model_max or chunk, chunk)
    if cfg.max_model_len is not None and model_max is not None and cfg.max_model_len > model_max:
        raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings={model_max}")
    want_len = cfg.max_model_len or model_max or 4096
    num_blocks = decide_num_blocks(
        specs, cfg.block_size, device, cfg.num_blocks, cfg.kv_cache_memory,
        cfg.kv_cache_memory_fraction, cfg.max_num_seqs, want_len,
    )
    if agree is not None:
        num_blocks = agree(num_blocks)
    capacity = num_blocks * cfg.block_size
    if cfg.max_model_len is not None and cfg.max_model_len > capacity:
        raise ValueError(
            f"max_model_len={cfg.max_model_len} does not fit the KV pool ({capacity} tokens); "
            "give more num_blocks / kv_cache_memory or a smaller max_model_len"
        )
    max_model_len = cfg.max_model_len or min(model_max or capacity, capacity)
    bytes_per_block = sum(s.bytes_per_token for s in specs) * cfg.block_size
    num_host_blocks = cfg.swap_space // bytes_per_block
    pool = KVPool(specs, num_blocks, cfg.block_size, device, num_host_blocks)
    logger.info(
        "KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB, %d layers, %s); max_model_len %d; swap space %d blocks",
        num_blocks, cfg.block_size, capacity, pool.total_bytes / 2**20, len(specs), str(pool.cache_dtype).removeprefix("torch."),
        max_model_len, num_host_blocks,
    )
    return pool, max_model_len


def own_linears(model: torch.nn.Module) -> OwnedLinears | None:
    """The engine's linear layer objects in place of the model's ``nn.Linear`` modules (shared with other engines
    on the same model; :mod:`hf_paged.model.layers.linear`), or None where the model has none to replace."""
    return model_patches.acquire(model, "linears", lambda: OwnedLinears(model))


def maybe_quantize(model: torch.nn.Module, cfg: EngineConfig, device: torch.device) -> QuantizedLinears | None:
    """The model's linears quantized at start and their activation mode (shared with other engines on the same
    model), or None where neither is asked for."""
    want = (cfg.quantization, cfg.quant_activations)
    if want == (None, "float") or (want == (None, "auto") and device.type != "cpu"):
        held = model_patches.current(model, "quantization")
        if held is not None and not held.serves(*want):  # it would run another engine's layers or kernel mode
            raise ValueError(
                f"quantization={cfg.quantization!r}, quant_activations={cfg.quant_activations!r}: another engine on "
                f"this model runs it with quantization={held.quantization!r}, quant_activations={held.activations!r} "
                "for as long as it lives; close it first, or ask for the same")
        return None  # ("auto" without quantized CPU layers has nothing to pick)
    if device.type != "cpu":
        raise ValueError(f"quantization={cfg.quantization!r} runs CPU kernels; this model is on {device}")
    quantized = model_patches.acquire(
        model, "quantization", lambda: QuantizedLinears(model, *want, max_rows=cfg.max_num_seqs))
    if quantized is not None and not quantized.serves(*want):
        model_patches.release(model, "quantization")
        raise ValueError(
            f"quantization={cfg.quantization!r}, quant_activations={cfg.quant_activations!r}: another engine on "
            f"this model runs it with quantization={quantized.quantization!r}, "
            f"quant_activations={quantized.activations!r}; close it first"
        )
    if quantized is None and cfg.quantization is not None:
        raise ValueError(f"quantization={cfg.quantization!r}: the model has no CPU nn.Linear layer to quantize")
    return quantized


def maybe_prepack(model: torch.nn.Module, cfg: EngineConfig, device: torch.device) -> PackedLinears | None:
    """The model's packed linears (shared with other engines on the same model), or None."""
    want = cfg.prepack_weights
    if want is None and cfg.decode_runner == "inductor" and not cfg.enforce_eager:
        return None  # our packed linears are opaque to inductor and break its graph
    if want is False or device.type != "cpu":
        if want not in (None, False):
            raise ValueError(f"prepack_weights={want!r} is for CPU models; this one is on {device}")
        return None
    kind = want if isinstance(want, str) else ("any" if want else "auto")

    packed = model_patches.acquire(model, "packing", lambda: PackedLinears(model, kind))
    if want is not None and packed is None and _all_quantized(model):
        # quantization (or a GGUF file) made every linear a QuantLinear, which has its own packed format: there is
        # nothing left for prepack_weights to pack, and the native decode program runs the quantized linears
        logger.info("prepack_weights=%r: every linear of the model is quantized (its own packed format); "
                    "nothing left to pack", want)
        return None
    if want is not None and packed is None:
        dtypes = sorted({p.dtype for p in model.parameters()}, key=str)
        tried = [k for k in packed_linear.KINDS if kind in ("any", k)]
        why = "; ".join(
            f"{k} for {str(d).removeprefix('torch.')}: {packed_linear.unavailable_reason(k, d) or 'slower than F.linear'}"
            for k in tried for d in dtypes if k in packed_linear.CANDIDATES.get(d, ())
        )
        if any(is_dense(m) and m.weight.is_inference() for m in model.modules()):
            why += "; weights made under torch.inference_mode are never packed (no version counter to see changes)"
        raise RuntimeError(f"prepack_weights={want!r}: no nn.Linear weight of this model can be packed here ({why})")
    return packed


def _all_quantized(model: torch.nn.Module) -> bool:
    """Whether the model's linears are all quantized ones (no plain ``nn.Linear`` left for packing)."""
    return any(type(m) is QuantLinear for m in model.modules()) and not any(is_dense(m) for m in model.modules())


def make_lora(model: torch.nn.Module, cfg: EngineConfig):
    """The engine's LoRA manager over the model's adaptable linears, its slots attached; and their undo."""
    linears = adaptable_linears(model)
    if not linears:
        raise ValueError("enable_lora: this model has no linear layers inside its decoder layers to adapt")
    shard = shard_of(model)  # a tensor-parallel rank: adapters are cut like their layers
    parts = shard.linear_parts if shard is not None else None
    manager = LoRAManager(linears, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras, parts)
    return manager, attach_slots(model, manager)


def maybe_fuse(model: torch.nn.Module, cfg: EngineConfig, device: torch.device, dtype: torch.dtype):
    """The model's fused decoder layers (shared with other engines on the same model), or None."""
    want = cfg.fuse_layers
    if want is False:
        return None
    why = ""
    if device.type != "cpu":
        why = f"the fused layers are CPU kernels; this model is on {device}"
    elif not fused_ops.available(dtype):
        why = fused_ops.unavailable_reason(dtype)
    if why:
        if want:
            raise RuntimeError(f"fuse_layers=True: {why}")
        return None

    fused = model_patches.acquire(model, "fused_layers", lambda: FusedLayers(model))
    if want and fused is None:
        raise RuntimeError(
            f"fuse_layers=True: no decoder layer of this model has a fused forward (families: {', '.join(FAMILIES)})"
        )
    return fused


def make_fast_runner(model, cfg: EngineConfig, pool: KVPool, layers: AttentionLayers, max_model_len: int, packed,
                     fused, block_tables: BlockTables, agree=None, lora=None):
    """The one fast step runner for this configuration and device, or None (every step eager): decode buckets
    (CUDA graphs, inductor, static; their attention runs the engine's backend) or, on CPU, the native decode
    program where the model fits it. ValueError naming the reason where ``decode_runner="native"`` (or
    ``"cuda_graphs"``) was asked for explicitly and cannot be had."""
    backend = layers.backend.name
    mode = resolve_mode(cfg.decode_runner, cfg.enforce_eager, pool.device, backend)
    if mode is None:
        return None
    if mode != "native":
        spec = cfg.speculative_config
        max_q = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        return DecodeBuckets(model, layers, pool.block_size, mode, cfg.decode_buckets, max_q, max_model_len,
                             block_tables, agree, lora)
    why = why_not(model, fused, packed)
    if not why and not layers.backend.native_max_q:  # the backend's choice, made once: "cpu" on a pool it reads
        why = f"it needs the native CPU attention (backend {backend!r}, {cpu_attention.unavailable_reason(pool.cache_dtype) or 'pool layout'})"
    program = None
    if not why:
        program = DecodeProgram(model, layers, min(cfg.max_num_seqs * cpu_attention.MAX_Q, cfg.max_num_batched_tokens),
                                lora=lora)
        if not hooks(skipped_modules(model)):  # a module hook is passing (steps run eagerly while it is there); else record now
            why = program.prepare()
    if why:
        if cfg.decode_runner == "native":
            raise ValueError(f"decode_runner='native' cannot run this model: {why}")
        logger.info("native decode program not used: %s", why)
        return None
    return program


def check_speculative(spec) -> None:
    """What can be checked about a speculative configuration without building its proposer (ValueError)."""
    if spec.method != "ngram" and isinstance(spec.model, str) and spec.self_draft_layers is None:
        if not os.path.isdir(spec.model):
            raise ValueError(f"speculative_config model {spec.model!r}: no such folder (give a model, a folder or 'self:N')")


def make_proposer(spec, runner, max_model_len: int, announce=None, cfg: EngineConfig | None = None):
    """The proposer a :class:`~hf_paged.spec_decode.SpeculativeConfig` asks for (``announce``: see
    :class:`~hf_paged.spec_decode.draft_model.DraftModelProposer`). Where the target runs the native decode
    program, a draft model gets one too (``cfg``: the engine's settings for the draft's layers)."""
    # the proposers are imported when one is asked for: an engine without speculation never needs them
    from hf_paged.spec_decode.draft_model import DraftModelProposer
    from hf_paged.spec_decode.ngram import NgramProposer

    check_speculative(spec)
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method in ("eagle3", "eagle"):
        return make_eagle_proposer(spec, runner)
    draft = spec.model
    if isinstance(draft, str) and spec.self_draft_layers is None:
        draft, _ = load_model(draft, dtype=next(runner.model.parameters()).dtype, device=runner.device)
    fast = None
    if isinstance(runner.fast, DecodeProgram) and announce is None and cfg is not None:
        owner = None if spec.self_draft_layers is None else runner.model  # self:N runs the target's layers
        fast = lambda model, layers: draft_program(model, layers, cfg, runner.fast.max_rows, owner)  # noqa: E731
    return DraftModelProposer(runner.model, runner.pool, runner.draft_logits, runner.attention_layers,
                              None if spec.self_draft_layers else draft, spec.self_draft_layers, max_model_len, announce,
                              fast)


def make_eagle_proposer(spec, runner) -> EagleProposer:
    """An EAGLE-3 proposer for ``spec.model`` (a head folder or a loaded head), and the runner told to capture
    the hidden states of the head's layers from now on (every step, by whichever step runner serves it)."""
    from hf_paged.spec_decode.eagle.eagle1 import Eagle1Head
    from hf_paged.spec_decode.eagle.eagle1_loading import check_eagle1, eagle1_layers
    from hf_paged.spec_decode.eagle.head import EagleHead
    from hf_paged.spec_decode.eagle.loading import aux_layers, check_head, load_head
    from hf_paged.spec_decode.eagle.proposer import EagleProposer

    head = spec.model
    num_layers = len(decoder_layers(runner.model))
    if spec.method == "eagle":
        if isinstance(head, str):
            head = load_head(head, runner.model, method="eagle")
        elif not isinstance(head, Eagle1Head):
            raise TypeError(f"speculative_config method 'eagle' takes a head folder or an Eagle1Head, got {type(head).__name__}")
        else:
            check_eagle1(head, runner.model)
        layers = eagle1_layers(num_layers)
    else:
        if isinstance(head, str):
            head = load_head(head, runner.model)
        elif not isinstance(head, EagleHead):
            raise TypeError(f"speculative_config method 'eagle3' takes a head folder or an EagleHead, got {type(head).__name__}")
        else:
            check_head(head, runner.model)
        layers = aux_layers(head.config, num_layers)
    tier_slots = runner.tiers.num_host_slots if runner.tiers is not None else 0
    proposer = EagleProposer(head, layers, runner.model, runner.pool, runner.prepare_batch, runner.attention_layers,
                             tier_slots)
    runner.capture_hidden(tuple(set(runner.hidden_layers) | set(layers)))
    return proposer


def draft_program(model: torch.nn.Module, layers: AttentionLayers, cfg: EngineConfig, max_rows: int,
                  owner: torch.nn.Module | None):
    """A draft model's native decode program over its attention ``layers`` and the function giving back what it
    took, or ``(None, that function)`` where the draft does not fit the program (its steps then run eagerly).

    ``owner``: None for a draft model of its own, which gets the target's kinds of layer objects first (linear
    layers, packing, fused decoder layers); the target for a ``self:N`` draft, a view of the target's own first
    layers (already made)."""
    held: list[str] = []

    def give_back() -> None:
        release_patches(model, held)
        held.clear()

    try:
        if owner is None:
            device = next(model.parameters()).device
            for name, make in (("linears", lambda: own_linears(model)), ("packing", lambda: maybe_prepack(model, cfg, device)),
                               ("fused_layers", lambda: maybe_fuse(model, cfg, device, next(model.parameters()).dtype))):
                if make() is not None:
                    held.append(name)
        program = DecodeProgram(model, layers, max_rows, owner)
        patched = model if owner is None else owner
        why = why_not(model, model_patches.current(patched, "fused_layers"), model_patches.current(patched, "packing"))
        why = why or program.prepare()
    except BaseException:
        give_back()
        raise
    if why:
        logger.info("draft model steps run eagerly (no native decode program: %s)", why)
        return None, give_back
    return program, give_back


def max_positions(model: torch.nn.Module) -> int | None:
    cfg = text_config(model)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def release_patches(model: torch.nn.Module, held: list[str]) -> None:
    """Give back the model patches ``held`` (names, in the order taken: undone in reverse)."""
    for name in reversed(held):
        model_patches.release(model, name)


def release_model(model: torch.nn.Module, held: list[str]) -> None:
    """Give back the model patches ``held`` and the attention."""
    release_patches(model, held)
    model_patches.release_attention(model)
