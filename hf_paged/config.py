"""Engine configuration: a small dataclass; user keyword arguments are checked against its fields."""

from __future__ import annotations

from dataclasses import dataclass, fields
from collections.abc import Sequence
from typing import Any

from hf_paged.kernels.cpu import isa
from hf_paged.core.prefill_pacer import check_max_itl_ratio
from hf_paged.core.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES, check_long_prefill_token_threshold
from hf_paged.kernels.ops import BACKENDS
from hf_paged.kernels.kv_quant import check_kv_cache_dtype
from hf_paged.kernels.cpu.packed_linear import KIND_NAMES as PACKING_KIND_NAMES
from hf_paged.kernels.cpu.packed_linear import KINDS as PACKING_KINDS
from hf_paged.model.layers.quantize import check_quantization
from hf_paged.spec_decode.config import SpeculativeConfig


DECODE_MODES = ("auto", "native", "static", "cuda_graphs", "inductor")
# A JSON schema with 800 optional properties compiles in ~6 s on a 2-core dev machine, 1,500 in ~52 s; a
# "maxLength": 256 string in 2-10 s (docs/structured_output.md): 20 s admits what real tool schemas need.


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_num_seqs`` (vLLM's capture sizes)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return tuple(sorted(set(sizes + [max_num_seqs])))


def check_buckets(buckets: object, max_num_seqs: int) -> tuple[int, ...]:
    """``decode_buckets`` as a tuple: positive, strictly increasing ints, none above ``max_num_seqs``."""
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
        raise TypeError(f"decode_buckets must be a list of ints, got {buckets!r}")
    if not buckets:
        raise ValueError("decode_buckets must not be empty (use enforce_eager=True to turn buckets off)")
    for b in buckets:
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"decode_buckets must hold ints, got {b!r} in {list(buckets)!r}")
        if b < 1:
            raise ValueError(f"decode_buckets must be >= 1, got {b} in {list(buckets)!r}")
    if any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"decode_buckets must be strictly increasing, got {list(buckets)!r}")
    if buckets[-1] > max_num_seqs:
        raise ValueError(f"decode bucket {buckets[-1]} is above max_num_seqs={max_num_seqs}")
    return tuple(buckets)


@dataclass
class EngineConfig:
    """Settings of a :class:`~hf_paged.PagedGenerator`.

    Args:
        block_size: Tokens per KV block (a power of two).
        num_blocks: Blocks in the KV pool. Overrides ``kv_cache_memory``.
        kv_cache_memory: Bytes for the KV pool (all layers, K and V).
        kv_cache_memory_fraction: Without the two above, the pool holds ``max_num_seqs`` sequences of
            ``min(max_model_len, 512)`` tokens (at least one of ``max_model_len``), but at most this fraction of
            the free memory (host RAM on CPU, device memory on CUDA).
        max_num_seqs: Most requests running at once.
        max_num_batched_tokens: Token budget of one step (decode tokens + prefill chunks).
        max_model_len: Longest sequence (prompt + output). Default: the model's
            ``max_position_embeddings``, capped at the pool's capacity.
        enable_chunked_prefill: Split prompts longer than the step's remaining budget across steps.
        long_prefill_token_threshold: With chunked prefill, the longest prefill chunk one sequence gets in a
            step while other sequences are decoding (vLLM's key), so a long prompt that arrives is spread over
            steps and running streams keep a bounded inter-token latency. None or 0: no cap but the budget.
        max_itl_ratio: With chunked prefill, while sequences decode, one sequence's prefill chunk is sized from
            measured step times so that a step takes at most about this multiple of a decode-only step: the
            running streams' inter-token latency stays within it while a long prompt arrives (at least 4 tokens
            a step, never above ``long_prefill_token_threshold``; per sequence, as the threshold, so a crowd of
            short prompts still joins at once). A number > 1; None or 0: no pacing (the threshold alone).
        attention_backend: "auto" (Triton on CUDA; on CPU the native kernel when it builds, else torch),
            "torch", "cpu" or "triton".
        seed: Seed of the engine generator used by sampled requests that bring no seed of their own.
        enable_prefix_caching: Hash full KV blocks so requests sharing a prompt prefix reuse its KV instead
            of recomputing it. Freed blocks keep their contents until evicted, least recently used first.
        scheduling_policy: "fcfs" (arrival order) or "priority" (``add_request(..., priority=)``, lower
            first; ties by arrival). Preemption always takes the last in that order.
        preemption_mode: When the pool runs out: "recompute" (drop the victim's KV, prefill it again later),
            "swap" (copy its blocks to ``swap_space`` host memory and back), or "auto" (swap the sequences of
            a group, i.e. n > 1 samples and beams, recompute single ones). Swap falls back to recompute when
            the swap space is full.
        swap_space: Bytes of host memory for swapped-out blocks (0: no swapping).
        speculative_config: Speculative decoding (vLLM's keys): a dict or
            :class:`~hf_paged.spec_decode.SpeculativeConfig` with ``method`` ("ngram" or "draft_model"),
            ``num_speculative_tokens``, ``prompt_lookup_min``/``prompt_lookup_max``, ``model`` (a draft model,
            a folder, or "self:N") and ``disable_by_batch_size``. None: off.
        prepack_weights: Pack ``nn.Linear`` weights once (CPU): faster engine matmuls for about the weights'
            size in extra memory. None: per dtype, the fastest of plain ``F.linear`` and the packings that
            pass their probe on this CPU (timed once at start); True: the fastest packing (error if none
            works); False: off; "mkl", "onednn", "native" or "upcast": that packing (error if it packs nothing here).
        fuse_layers: Fused CPU forward for Llama, Mistral and Qwen2 decoder layers (RMSNorm, rotary, SiLU-mul
            and residual adds in C, attention without transposes; same math, rounded like transformers').
            None: on for CPU models where it applies and its kernels build and pass their probe; True: on
            (error if nothing can be fused here); False: this engine installs no fused forward (the patch
            belongs to the model: while another engine on the same model holds it, every engine forward takes it).
        enforce_eager: Run every step eagerly on exact shapes: no decode buckets, CUDA graphs or compilation.
        decode_runner: How decode steps (every sequence adds 1 token, or 1 + k when verifying drafts) run
            when not ``enforce_eager``: "auto" (CUDA graphs on CUDA; on CPU the native decode program where
            the model fits it, else the dynamic eager path), "native" (the step's kernel calls recorded once
            and replayed, no padding: :mod:`hf_paged.executor.native_program`; error if the model does not fit),
            "cuda_graphs", "inductor" (``torch.compile`` per bucket, cached on disk; turns weight packing off)
            or "static" (padded buckets run eagerly: the CPU twin of the graphs).
        decode_buckets: Batch sizes decode steps are padded up to (positive, increasing, at most
            ``max_num_seqs``). None: 1, 2, 4, 8, 16, 32, 48, ... up to ``max_num_seqs``.
        quantization: Quantize the model's linear layers at start, weight-only, for the CPU kernels of
            :mod:`hf_paged.model.layers.quant_linear`: "int8" (per output channel) or "int4" (groups of 32 with a scale
            and a min), the LM head as q8_0 in both cases. None: the weights as they are. The original layers
            come back at the last ``close()``. See docs/quantization.md.
        quant_activations: The quantized linears' kernel mode: "float" (fp32 activations, the exact reference),
            "int8" (activations rounded to int8 per block of 32 and integer dot products) or "bf16" (activations
            and dequantized weights rounded to bf16, AMX-BF16 tiles; where the CPU has none, the float kernel
            with one warning): faster, slightly different numbers; or "auto": the fastest of those whose kernel
            works here (bf16 only with AMX-BF16), timed once at start on one of the model's quantized layers at
            1, 16 and 64 rows (at most ``max_num_seqs``), float unless another is 10% faster
            (:mod:`hf_paged.model.layers.quant_modes`). Applies to the layers ``quantization`` makes and to a GGUF
            model's own.
        tensor_parallel_size: Processes the model is sharded over (tensor parallelism on ``torch.distributed``,
            gloo on CPU, NCCL on CUDA): the engine spawns ``N - 1`` workers, or joins ``torchrun``'s ranks.
            See docs/tensor_parallel.md.
        distributed_timeout: Seconds a tensor-parallel collective (or the group's start) may wait for a rank.
        kv_cache_dtype: How the KV pool stores keys and values (vLLM's key): "auto" (the model's dtype) or
            "int8" (per token-and-head symmetric int8 with an fp32 scale: about 3.8x the tokens of an fp32 pool
            and 1.9x of a bf16 one in the same memory, at a small accuracy cost). See docs/quantization.md.
        structured_compile_timeout_s: Seconds one new structured-output grammar (JSON schema, regex, grammar,
            choice) may take to compile. Each new spec is first compiled in a child process that is killed past
            this budget (the request is then a ValueError, a 400 on the server, naming this setting) or when its
            caller gives up (a server client that disconnects). None (the default) or 0: compile in the engine's
            process with no budget and no way to stop it. ``hf-paged serve`` and ``chat`` set 20 s unless told
            otherwise (``--structured-compile-timeout-s``). See docs/structured_output.md.
        kv_offload_gb: GiB of host memory for cached prefix blocks evicted from the pool (the host tier; 0: none).
            A prefix lookup that misses in the pool finds them there and copies them back. See docs/kv_tiers.md.
        kv_offload_dtype: How the host tier stores blocks: "auto" (the pool's bytes, exact) or "int8" (int8
            rows with a scale, ~3.8x the blocks of an fp32 pool; a block promoted from it is not bit-exact).
        prefix_cache_dir: A folder where every computed full block is also written (in the background), keyed
            by its hash chain and a fingerprint of the model, dtype and layout: a later engine (another process,
            after a restart) on the same folder reads its prefixes back. None: no disk tier.
        prefix_cache_disk_gb: Cap on the disk tier's size, least recently used files deleted first (None: no cap).
        enable_lora: Serve PEFT LoRA adapters per request (``lora_request=``; docs/lora.md). Steps with adapter
            rows run on the native decode program (CPU) and the static / CUDA-graph decode buckets where those
            take the step (the adapter deltas as per-token kernels over a static slot index on CUDA), else on
            the eager forward. Refused with ``decode_runner="inductor"``.
        max_loras: With ``enable_lora``, the most distinct adapters one step mixes (resident at once); requests
            of more adapters wait.
        max_lora_rank: With ``enable_lora``, the largest adapter rank accepted (the slots are padded to it).
        max_cpu_loras: With ``enable_lora``, adapters whose weights stay in host memory (least recently used
            dropped first, read again from their folder when needed); None: ``max_loras``.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.25
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = 256
    max_itl_ratio: float | None = 3.0
    attention_backend: str = "auto"
    seed: int = 0
    prepack_weights: bool | str | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "auto"
    swap_space: int = 0
    speculative_config: Any = None
    fuse_layers: bool | None = None
    enforce_eager: bool = False
    decode_runner: str = "auto"
    decode_buckets: Any = None
    quantization: str | None = None
    tensor_parallel_size: int = 1
    distributed_timeout: float = 60.0
    kv_cache_dtype: str = "auto"
    quant_activations: str = "float"
    structured_compile_timeout_s: float | None = None
    kv_offload_gb: float = 0.0
    kv_offload_dtype: str = "auto"
    prefix_cache_dir: str | None = None
    prefix_cache_disk_gb: float | None = None
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "seed"):
            _require_int(name, getattr(self, name), 1 if name != "seed" else 0)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("num_blocks", "kv_cache_memory", "max_model_len"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name), 1)
        if not isinstance(self.kv_cache_memory_fraction, (int, float)) or not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction!r}")
        check_long_prefill_token_threshold(self.long_prefill_token_threshold)
        isa.forced_level()  # a bad HF_PAGED_ISA (unknown, or above this CPU) fails the engine's start, by name
        check_max_itl_ratio(self.max_itl_ratio)
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _require_int("swap_space", self.swap_space, 0)
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if self.fuse_layers is not None and not isinstance(self.fuse_layers, bool):
            raise TypeError(f"fuse_layers must be None or a bool, got {self.fuse_layers!r}")
        if not isinstance(self.enforce_eager, bool):
            raise TypeError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        if self.decode_runner not in DECODE_MODES:
            raise ValueError(f"decode_runner must be one of {DECODE_MODES}, got {self.decode_runner!r}")
        self.decode_buckets = (
            default_buckets(self.max_num_seqs) if self.decode_buckets is None
            else check_buckets(self.decode_buckets, self.max_num_seqs)
        )
        if self.decode_runner == "inductor" and self.prepack_weights not in (None, False):
            raise ValueError(
                f"decode_runner='inductor' compiles plain nn.Linear modules; prepack_weights={self.prepack_weights!r} conflicts "
                "with it (leave it None)"
            )
        check_quantization(self.quantization, self.quant_activations)
        _require_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if isinstance(self.distributed_timeout, bool) or not isinstance(self.distributed_timeout, (int, float)) or not (
            self.distributed_timeout > 0
        ):
            raise ValueError(f"distributed_timeout must be a positive number of seconds, got {self.distributed_timeout!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        timeout = self.structured_compile_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
            raise TypeError(f"structured_compile_timeout_s must be a number of seconds or None, got {timeout!r}")
        if timeout is not None and not 0 <= timeout < float("inf"):
            raise ValueError(f"structured_compile_timeout_s must be a finite number of seconds >= 0 (0 or None: no "
                             f"budget), got {timeout!r}")
        check_kv_tiers(self)
        self._check_lora()
        pw = self.prepack_weights
        if not (pw is None or isinstance(pw, bool) or (isinstance(pw, str) and pw in PACKING_KINDS)):
            raise ValueError(f"prepack_weights must be None, True, False, {PACKING_KIND_NAMES}, got {self.prepack_weights!r}")

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise TypeError(f"enable_lora must be a bool, got {self.enable_lora!r}")
        _require_int("max_loras", self.max_loras, 1)
        _require_int("max_lora_rank", self.max_lora_rank, 1)
        if self.max_cpu_loras is not None:
            _require_int("max_cpu_loras", self.max_cpu_loras, 1)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")
        if not self.enable_lora:
            return
        if self.decode_runner == "inductor":
            raise ValueError("decode_runner='inductor' conflicts with enable_lora (the adapter slots read the step's "
                             "plan, a Python object torch.compile would recompile for at every step); use 'auto', "
                             "'cuda_graphs' or 'static'")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - allowed)
        if unknown:
            raise TypeError(f"unknown engine config key(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**kwargs)


KV_OFFLOAD_DTYPES = ("auto", "int8")


def check_kv_tiers(cfg: EngineConfig) -> None:
    """ValueError/TypeError naming a bad KV-tier setting (docs/kv_tiers.md)."""
    for name in ("kv_offload_gb", "prefix_cache_disk_gb"):
        value = getattr(cfg, name)
        if value is None and name == "prefix_cache_disk_gb":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite number of GiB >= 0, got {value!r}")
    if cfg.kv_offload_dtype not in KV_OFFLOAD_DTYPES:
        raise ValueError(f"kv_offload_dtype must be one of {KV_OFFLOAD_DTYPES}, got {cfg.kv_offload_dtype!r}")
    if cfg.prefix_cache_dir is not None and (not isinstance(cfg.prefix_cache_dir, str) or not cfg.prefix_cache_dir):
        raise TypeError(f"prefix_cache_dir must be a folder path (str) or None, got {cfg.prefix_cache_dir!r}")
    if (cfg.kv_offload_gb or cfg.prefix_cache_dir is not None) and not cfg.enable_prefix_caching:
        raise ValueError("kv_offload_gb and prefix_cache_dir keep cached prefixes: they need enable_prefix_caching=True")


def _require_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
