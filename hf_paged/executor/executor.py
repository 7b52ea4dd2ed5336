"""The executor: the one object the engine runs steps through (vLLM's ``Executor``, at our size).

The engine hands it a plain-data :class:`~hf_paged.core.scheduler_output.SchedulerOutput` and gets a plain
:class:`~hf_paged.core.scheduler_output.ModelRunnerOutput` back. :class:`UniProcExecutor` runs the model in
this process; :class:`~hf_paged.executor.multiproc.TensorParallelExecutor` runs a tensor-parallel group behind
the same calls (rank 0 broadcasts the scheduler output, every rank runs its shard's step). Whatever the execution layer changes on the model
(the "hf_paged" attention, packed linears, fused layers) it takes when built and gives back in :meth:`close`,
or when garbage-collected.

Code outside ``hf_paged/executor/`` uses an executor only through :class:`Executor`'s contract (the names in
:attr:`Executor.CONTRACT`); ``tests/test_executor_contract.py`` checks that nothing reaches past it (to the
model runner or what it holds).
"""

from __future__ import annotations

import abc
import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf_paged.model import patches as model_patches
from hf_paged.model.layers import kernel_choices
from hf_paged.attention.backends import make_backend
from hf_paged.attention.layer import AttentionLayers
from hf_paged.config import EngineConfig
from hf_paged.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from hf_paged.kernels.cpu import attention as cpu_attention
from hf_paged.executor.decode_buckets import DecodeBuckets
from hf_paged.executor.input_batch import BlockTables
from hf_paged.executor.model_runner import ModelRunner
from hf_paged.executor.setup import (
    build_pool, make_fast_runner, make_lora, make_proposer, maybe_fuse, maybe_prepack, maybe_quantize, own_linears,
    release_model,
)
from hf_paged.kernels.ops import resolve_backend
from hf_paged.executor.kv_pool import KVPool
from hf_paged.executor.kv_tiers import TierStore, make_tier_store
from hf_paged.sample.sampling import Sampler

if TYPE_CHECKING:
    from hf_paged.model.layers.fused_decoder import FusedLayers
    from hf_paged.model.layers.packed import PackedLinears
    from hf_paged.model.layers.quantize import QuantizedLinears

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecutorSetup:
    """What an executor built at start, as it is now. Live objects that the executor owns: read them, never
    change them (after :meth:`Executor.close` the layer objects read None).

    Attributes:
        pool: The KV pool (:class:`~hf_paged.executor.kv_pool.KVPool`; under tensor parallelism, rank 0's: its KV heads).
        backend: The attention backend in use: "cpu", "torch" or "triton".
        packed: The model's packed linears, or None.
        fused: The model's fused decoder layers, or None.
        quantized: The model's quantized linears and their activation mode, or None.
    """

    pool: KVPool
    backend: str
    packed: PackedLinears | None = None
    fused: FusedLayers | None = None
    quantized: QuantizedLinears | None = None


class Executor(abc.ABC):
    """What the engine needs from the execution layer, whatever runs it.

    This is the whole contract: code outside ``hf_paged/executor/`` uses the names in :attr:`CONTRACT` and
    nothing else (not the model runner, nor what it holds). The attributes are set when the executor is built
    and are read-only for callers.

    Attributes:
        model: The model the engine serves: the caller's model in one process, rank 0's shard under tensor
            parallelism. The engine reads its config and embeddings; ``unwrap`` gives it back.
        max_model_len: The longest sequence (prompt + output) a step may hold.
        num_blocks: Blocks of the KV pool (the scheduler's block manager gets as many).
        num_host_blocks: Blocks of the host (swap) pool.
        failure: Why this executor can run no more steps, in one short line for clients (no library paths), or
            None while it can. Set once, for good (a tensor-parallel group whose rank died); every later step
            raises.
        comm_seconds: Seconds spent sending steps to other ranks (0 in one process; the all-reduces inside
            the forward are counted by :data:`hf_paged.executor.tensor_parallel.COMM`).
        kv_tiers: The store of the KV tiers below the pool (host memory, disk folder), or None; the engine
            hands it to its block manager's :class:`~hf_paged.core.kv_tiers.KVTiers`.
        lora: With ``enable_lora``, the engine's adapters (:class:`~hf_paged.lora.manager.LoRAManager`): the
            engine adds, removes and lists adapters through it; None otherwise.
    """

    # the names callers may use (tests/test_executor_contract.py holds code outside the package to them)
    CONTRACT = frozenset({
        "model", "max_model_len", "num_blocks", "num_host_blocks", "failure", "comm_seconds",
        "describe", "check_health", "execute_model", "add_proposer", "has_proposer", "weights_changed",
        "watches_weights", "close", "kv_tiers", "lora",
    })

    model: torch.nn.Module
    max_model_len: int
    num_blocks: int
    num_host_blocks: int
    failure: str | None = None
    comm_seconds: float = 0.0
    kv_tiers: TierStore | None = None
    lora = None  # the LoRA adapters (a LoRAManager: add, remove, list) with enable_lora, else None

    @abc.abstractmethod
    def describe(self) -> ExecutorSetup:
        """What this executor built at start (its KV pool, attention backend, packed, fused and quantized
        layers), as they are now."""

    def check_health(self) -> str | None:
        """Look for a failure between steps (cheap: a tensor-parallel group checks its worker processes) and
        return :attr:`failure`."""
        return self.failure

    @abc.abstractmethod
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step (an empty one only drops the finished sequences' state)."""

    @abc.abstractmethod
    def add_proposer(self, key: str, spec) -> None:
        """Make the speculative proposer for ``spec`` under ``key`` (once per distinct configuration)."""

    @abc.abstractmethod
    def has_proposer(self, key: str) -> bool:
        """Whether the proposer under ``key`` was made (:meth:`add_proposer`)."""

    @abc.abstractmethod
    def weights_changed(self) -> None:
        """A weight changed in place or was replaced: drop what was built from the old ones (graphs)."""

    @property
    @abc.abstractmethod
    def watches_weights(self) -> bool:
        """Whether every step must check the weights (something built from them would go stale)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the KV pool and what was built, and give the model back (last user of each patch)."""


class UniProcExecutor(Executor):
    """The model, its KV pool and its model runner in this process.

    Args:
        model: The HF model (switched to the "hf_paged" attention for as long as this executor lives).
        cfg: The engine configuration.
        agree: Tensor parallelism: makes the ranks agree on the pool's block count (the smallest wins).
    """

    def __init__(self, model: torch.nn.Module, cfg: EngineConfig, agree=None) -> None:
        self.model = model
        self.cfg = cfg
        self.device = next(model.parameters()).device
        self.linears = self.packed = self.fused = self.quantized = None
        detach_lora = None
        model_patches.acquire_attention(model)
        try:
            self.linears = own_linears(model)  # first: quantizing, packing and LoRA act on these layer objects
            self.quantized = maybe_quantize(model, cfg, self.device)
            self.pool, self.max_model_len = build_pool(model, cfg, self.device, agree)
            self.backend = resolve_backend(cfg.attention_backend, self.device, self.pool.cache_dtype)
            self.packed = maybe_prepack(model, cfg, self.device)
            self.fused = maybe_fuse(model, cfg, self.device, self.pool.specs[0].dtype)
            kernel_choices.agree(model)  # a tensor-parallel shard: every rank runs the kernels rank 0 timed fastest
            if cfg.enable_lora:
                self.lora, detach_lora = make_lora(model, cfg)
            native_max_q = cpu_attention.MAX_Q if self.backend == "cpu" and self.pool.supports_native() else 0
            # the backend object, once, and one attention layer object per decoder layer over this engine's pool
            attention = AttentionLayers.for_pool(self.pool, make_backend(self.backend, cfg.block_size, native_max_q))
            tables = BlockTables()
            fast = make_fast_runner(model, cfg, self.pool, attention, self.max_model_len, self.packed, self.fused,
                                    tables, agree, self.lora)
            self.runner = ModelRunner(model, self.pool, attention, Sampler(self.device, cfg.seed), self.max_model_len,
                                      fast, tables, self.lora)
            self.kv_tiers = self.runner.tiers = make_tier_store(model, cfg, self.pool, self.max_model_len, agree)
        except BaseException:
            if detach_lora is not None:
                detach_lora()
            release_model(model, self._held())
            raise
        self.num_blocks = self.pool.num_blocks
        self.num_host_blocks = self.pool.num_host_blocks
        # An executor dropped without close() gives the model back when it is garbage-collected.
        self._release = weakref.finalize(self, _release, model, self._held(), detach_lora)

    def _held(self) -> list[str]:
        """The model patches this executor holds, in the order they were taken."""
        held = [("linears", self.linears), ("quantization", self.quantized), ("packing", self.packed),
                ("fused_layers", self.fused)]
        return [name for name, obj in held if obj is not None]

    def describe(self) -> ExecutorSetup:
        return ExecutorSetup(self.pool, self.backend, self.packed, self.fused, self.quantized)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = self.runner.execute(out)
        if self.kv_tiers is not None:
            self.kv_tiers.save(out.tier_moves)  # the forward completed these blocks: to disk, in the background
        return result

    def execute_forward(self, out: SchedulerOutput) -> None:
        """A tensor-parallel worker rank's step: the block moves and the forward of :meth:`execute_model` (its
        collectives meet rank 0's), without sampling (rank 0 samples)."""
        self.runner.execute_forward(out)
        if self.kv_tiers is not None:
            self.kv_tiers.save(out.tier_moves)

    def add_proposer(self, key: str, spec, announce=None) -> None:
        self.runner.speculator.add(key, make_proposer(spec, self.runner, self.max_model_len, announce, self.cfg))

    def has_proposer(self, key: str) -> bool:
        return key in self.runner.speculator.proposers

    def weights_changed(self) -> None:
        if isinstance(self.runner.fast, DecodeBuckets):
            self.runner.fast.weights_changed()

    @property
    def watches_weights(self) -> bool:
        return isinstance(self.runner.fast, DecodeBuckets)

    def close(self) -> None:
        if self.kv_tiers is not None:
            self.kv_tiers.close()  # the writer thread writes what is queued first
        self.runner.close()
        self._release()  # once: the finalizer is dead afterwards
        self.linears = self.packed = self.fused = self.quantized = self.lora = None
        self.pool.kv_caches.clear()
        self.pool.host_caches.clear()


def _release(model: torch.nn.Module, held: list[str], detach_lora) -> None:
    if detach_lora is not None:  # the LoRA slots come off the model's linears first
        detach_lora()
    release_model(model, held)
