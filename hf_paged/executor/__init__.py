"""The execution layer: one executor, its model runner, step runners (eager, decode buckets, the CPU native
program) and the pieces they are built from."""

from hf_paged.executor.executor import Executor, UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
