"""The execution layer: one executor, its model runner, step runners (eager, decode buckets, the CPU native
program) and the pieces they are built from. Code outside this package uses :class:`Executor`'s contract only."""

from hf_paged.executor.executor import Executor, ExecutorSetup, UniProcExecutor
from hf_paged.executor.factory import make_executor

__all__ = ["Executor", "ExecutorSetup", "UniProcExecutor", "make_executor"]
