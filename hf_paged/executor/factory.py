"""Choosing the executor for an engine configuration: this process, or a tensor-parallel group."""

from __future__ import annotations

import os

from hf_paged.config import EngineConfig
from hf_paged.executor.executor import Executor, UniProcExecutor
from hf_paged.executor.shard_loading import ModelSource


def make_executor(model, cfg: EngineConfig) -> Executor:
    """The executor for ``cfg``: :class:`UniProcExecutor` over ``model``, or, with ``tensor_parallel_size`` > 1,
    a :class:`~hf_paged.executor.multiproc.TensorParallelExecutor` (``model`` may then be a folder path or a
    :class:`ModelSource`: every rank loads its shard)."""
    if cfg.tensor_parallel_size > 1:
        from hf_paged.executor.multiproc import TensorParallelExecutor  # torch.distributed: only when asked for

        return TensorParallelExecutor(model, cfg)
    if isinstance(model, (ModelSource, str, os.PathLike)):
        raise TypeError("a model path or source needs tensor_parallel_size > 1; load the model first (load_model)")
    return UniProcExecutor(model, cfg)
