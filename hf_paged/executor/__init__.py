"""The execution layer: one executor, its model runner, step runners (eager, decode buckets, the CPU native
program), the KV pool tensors (``kv_pool.py``) and the pieces they are built from. Code outside this package
uses :class:`Executor`'s contract only.

The names below are looked up on first use: importing ``hf_paged.executor.kv_pool`` (as the draft model of
``spec_decode/`` does) must not import the executor, which builds draft models.
"""

import importlib

_WHERE = {"Executor": "executor", "ExecutorSetup": "executor", "UniProcExecutor": "executor", "make_executor": "factory"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"hf_paged.executor.{_WHERE[name]}"), name)
