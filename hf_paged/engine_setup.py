"""Building an engine's pieces from a model and an :class:`EngineConfig`: the KV pool, packed linears,
stop tokens, and prompt validation."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from hf_paged import attention, model_patches
from hf_paged.config import EngineConfig
from hf_paged.cpu import attention as cpu_attention, fused_ops, packed_linear
from hf_paged.cpu.packed_model import PackedLinears
from hf_paged.kv_pool import KVPool, decide_num_blocks, probe_kv_layout

logger = logging.getLogger(__name__)


def build_pool(model: torch.nn.Module, cfg: EngineConfig, device: torch.device) -> tuple[KVPool, int]:
    """The KV pool for ``model`` and the engine's ``max_model_len``."""
    if model.training:
        logger.warning("model is in training mode: dropout will make generation random; call model.eval()")
    specs = probe_kv_layout(model)
    model_max = max_positions(model)
    chunk = attention.chunked_attention_size(model)
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
        "KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB, %d layers); max_model_len %d; swap space %d blocks",
        num_blocks, cfg.block_size, capacity, pool.total_bytes / 2**20, len(specs), max_model_len, num_host_blocks,
    )
    return pool, max_model_len


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

    packed = model_patches.acquire(model, "packing", lambda: PackedLinears(model, attention.engine_forward_active, kind))
    if want is not None and packed is None:
        dtypes = sorted({p.dtype for p in model.parameters()}, key=str)
        tried = [k for k in packed_linear.KINDS if kind in ("any", k)]
        why = "; ".join(
            f"{k} for {str(d).removeprefix('torch.')}: {packed_linear.unavailable_reason(k, d) or 'slower than F.linear'}"
            for k in tried for d in dtypes if k in packed_linear.CANDIDATES.get(d, ())
        )
        if any(type(m) is torch.nn.Linear and m.weight.is_inference() for m in model.modules()):
            why += "; weights made under torch.inference_mode are never packed (no version counter to see changes)"
        raise RuntimeError(f"prepack_weights={want!r}: no nn.Linear weight of this model can be packed here ({why})")
    return packed


def make_decode_runner(model: torch.nn.Module, cfg: EngineConfig, pool: KVPool, backend: str, max_model_len: int):
    """The bucketed static decode runner this configuration asks for on this device, or None."""
    from hf_paged.decode_runner import DecodeGraphRunner, resolve_mode

    mode = resolve_mode(cfg.decode_runner, cfg.enforce_eager, pool.device)
    if mode is None or mode == "native":
        return None
    spec = cfg.speculative_config
    max_q = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    return DecodeGraphRunner(model, pool.kv_caches, pool.block_size, mode, cfg.decode_buckets, max_q, max_model_len,
                             backend)


def make_program(model: torch.nn.Module, cfg: EngineConfig, pool: KVPool, backend: str, packed, fused):
    """The native decode program (``decode_runner`` "native", or "auto" on CPU) where the model fits it, else
    None; ValueError naming the reason where "native" was asked for explicitly and cannot be had."""
    from hf_paged.decode_runner import resolve_mode
    from hf_paged.cpu.native_program import DecodeProgram  # hf/ imports the engine: import late
    from hf_paged.cpu.program_fit import hooks, skipped_modules, why_not

    if resolve_mode(cfg.decode_runner, cfg.enforce_eager, pool.device) != "native":
        return None
    why = why_not(model, fused, packed)
    if not why and (backend != "cpu" or not pool.supports_native() or not cpu_attention.available(pool.specs[0].dtype)):
        why = f"it needs the native CPU attention (backend {backend!r}, {cpu_attention.unavailable_reason(pool.specs[0].dtype) or 'pool layout'})"
    program = None
    if not why:
        program = DecodeProgram(model, pool.kv_caches, min(cfg.max_num_seqs * cpu_attention.MAX_Q, cfg.max_num_batched_tokens))
        if not hooks(skipped_modules(model)):  # a module hook is passing (steps run eagerly while it is there); else record now
            why = program.prepare()
    if why:
        if cfg.decode_runner == "native":
            raise ValueError(f"decode_runner='native' cannot run this model: {why}")
        logger.info("native decode program not used: %s", why)
        return None
    return program


def make_proposer(spec, runner, max_model_len: int):
    """The proposer a :class:`~hf_paged.spec_decode.SpeculativeConfig` asks for."""
    if spec.method == "ngram":
        from hf_paged.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from hf_paged.spec_decode.draft_model import DraftModelProposer

    draft = spec.model
    if isinstance(draft, str) and spec.self_draft_layers is None:
        from hf_paged.default_model import load_model

        if not os.path.isdir(draft):
            raise ValueError(f"speculative_config model {draft!r}: no such folder (give a model, a folder or 'self:N')")
        draft, _ = load_model(draft, dtype=next(runner.model.parameters()).dtype, device=runner.device)
    return DraftModelProposer(runner, None if spec.self_draft_layers else draft, spec.self_draft_layers, max_model_len)


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


def max_positions(model: torch.nn.Module) -> int | None:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


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


def maybe_fuse(model: torch.nn.Module, cfg: EngineConfig, device: torch.device, dtype: torch.dtype):
    """The model's fused decoder layers (shared with other engines on the same model), or None."""
    from hf_paged.cpu.fused_layers import (  # hf/ imports the engine: import late
        FAMILIES,
        FusedLayers,
    )

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


def release_model(model: torch.nn.Module, packed: bool, fused: bool = False) -> None:
    if packed:
        model_patches.release(model, "packing")
    if fused:
        model_patches.release(model, "fused_layers")
    model_patches.release_attention(model)


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
