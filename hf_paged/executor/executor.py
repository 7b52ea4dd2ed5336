"""The executor: the one object the engine runs steps through (vLLM's ``Executor``, at our size).

The engine hands it a plain-data :class:`~hf_paged.core.scheduler_output.SchedulerOutput` and gets a plain
:class:`~hf_paged.core.scheduler_output.ModelRunnerOutput` back. :class:`UniProcExecutor` runs the model in
this process; :class:`~hf_paged.executor.multiproc.TensorParallelExecutor` runs a tensor-parallel group behind
the same calls (rank 0 broadcasts the scheduler output, every rank runs its shard's step). Whatever the execution layer changes on the model
(the "hf_paged" attention, packed linears, fused layers) it takes when built and gives back in :meth:`close`,
or when garbage-collected.
"""

from __future__ import annotations

import abc
import logging
import weakref

import torch

from hf_paged import model_patches
from hf_paged.attention_backends import make_backend
from hf_paged.attention_layer import AttentionLayers
from hf_paged.config import EngineConfig
from hf_paged.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from hf_paged.cpu import attention as cpu_attention
from hf_paged.executor.decode_buckets import DecodeBuckets
from hf_paged.executor.input_batch import BlockTables
from hf_paged.executor.model_runner import ModelRunner
from hf_paged.executor.setup import (
    build_pool, make_fast_runner, make_proposer, maybe_fuse, maybe_prepack, maybe_quantize, release_model,
)
from hf_paged.kernels import resolve_backend
from hf_paged.sampling import Sampler

logger = logging.getLogger(__name__)


class Executor(abc.ABC):
    """What the engine needs from the execution layer, whatever runs it."""

    max_model_len: int
    num_blocks: int
    num_host_blocks: int
    # Why this executor can run no more steps, in one short line for clients (no library paths), or None while
    # it can. Set once, for good (a tensor-parallel group whose rank died); every later step raises.
    failure: str | None = None

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
    def has_proposer(self, key: str) -> bool: ...

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
        self.device = next(model.parameters()).device
        self.packed = self.fused = self.quantized = None
        model_patches.acquire_attention(model)
        try:
            self.quantized = maybe_quantize(model, cfg, self.device)
            self.pool, self.max_model_len = build_pool(model, cfg, self.device, agree)
            self.backend = resolve_backend(cfg.attention_backend, self.device, self.pool.cache_dtype)
            self.packed = maybe_prepack(model, cfg, self.device)
            self.fused = maybe_fuse(model, cfg, self.device, self.pool.specs[0].dtype)
            native_max_q = cpu_attention.MAX_Q if self.backend == "cpu" and self.pool.supports_native() else 0
            # the backend object, once, and one attention layer object per decoder layer over this engine's pool
            attention = AttentionLayers.for_pool(self.pool, make_backend(self.backend, cfg.block_size, native_max_q))
            tables = BlockTables()
            fast = make_fast_runner(model, cfg, self.pool, attention, self.max_model_len, self.packed, self.fused,
                                    tables)
            self.runner = ModelRunner(model, self.pool, attention, Sampler(self.device, cfg.seed), self.max_model_len,
                                      fast, tables)
        except BaseException:
            release_model(model, self.packed is not None, self.fused is not None, self.quantized is not None)
            raise
        self.num_blocks = self.pool.num_blocks
        self.num_host_blocks = self.pool.num_host_blocks
        # An executor dropped without close() gives the model back when it is garbage-collected.
        self._release = weakref.finalize(self, release_model, model, self.packed is not None, self.fused is not None,
                                         self.quantized is not None)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)

    def add_proposer(self, key: str, spec) -> None:
        self.runner.speculator.add(key, make_proposer(spec, self.runner, self.max_model_len))

    def has_proposer(self, key: str) -> bool:
        return key in self.runner.speculator.proposers

    def weights_changed(self) -> None:
        if isinstance(self.runner.fast, DecodeBuckets):
            self.runner.fast.weights_changed()

    @property
    def watches_weights(self) -> bool:
        return isinstance(self.runner.fast, DecodeBuckets)

    def close(self) -> None:
        self.runner.close()
        self._release()  # once: the finalizer is dead afterwards
        self.packed = self.fused = self.quantized = None
        self.pool.kv_caches.clear()
        self.pool.host_caches.clear()
