"""The ``hf-paged`` process from start to exit: cyclic garbage collection paused while the engine is built, and
an exit that skips the interpreter's teardown.

Importing torch and transformers' model classes makes ~650k Python objects, and each full collection on the
way walks all of them: on the 2-core hosts the collector took ~0.6 s of a ~3.3 s import. At exit the
interpreter's teardown walks them again (~0.8 s) to free memory the operating system takes back anyway. So:

- :func:`start_up` runs a command's engine building (imports, loading, ``PagedGenerator(...)``) with the
  collector off, then freezes what it made (modules, classes, the model and engine: they live as long as the
  process) out of every later collection and turns the collector back on. A server collects start-up's garbage
  first; ``generate`` and ``batch``, which end soon after, keep it (a collection over everything costs ~0.3 s
  on the 2-core hosts; the garbage of a default start is ~12k small objects, no tensors);
- :func:`quick_exit` ends a command that returned normally right after the ``atexit`` handlers (engines
  closed, logs flushed; non-daemon threads are joined before those run), without the teardown.

Both are part of the launcher's process tuning (:mod:`hf_paged.launch`): :func:`enable` turns them on in the
``hf-paged`` process, and ``HF_PAGED_TUNE=0`` leaves them off with the rest. A program or a test that calls
:func:`hf_paged.cli.main` keeps its collector and its exit as they are.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys

_enabled = False  # enable() was called: this process is the hf-paged command
_collect = True  # start_up() collects before freezing (a long-lived command)
_exit_status: int | None = None  # quick_exit()'s status, for the last atexit handler


def enable(long_lived: bool = True) -> None:
    """Turn both on for this process; ``long_lived``: a server, whose start-up garbage is collected. Call it
    before torch and the rest register their ``atexit`` handlers: handlers run last registered first, so the
    exit handler registered here runs after all of them."""
    global _enabled, _collect
    _collect = long_lived
    if not _enabled:
        _enabled = True
        atexit.register(_exit_now)


@contextlib.contextmanager
def start_up():
    """The block that builds the engine, with the collector paused (where :func:`enable` was called and the
    collector is on)."""
    if not _enabled or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if _collect:
            gc.collect()
        gc.freeze()
        gc.enable()


def quick_exit(status: int) -> int:
    """Let the process end with ``status`` once the ``atexit`` handlers have run (where :func:`enable` was
    called); returns ``status``."""
    global _exit_status
    if _enabled:
        _exit_status = status
    return status


def usual_exit() -> None:
    """The interpreter's full exit after all (a command ending with an exception): what was frozen is freed
    by the teardown again, as native bindings that check for leaked objects at exit expect."""
    global _exit_status
    _exit_status = None
    gc.unfreeze()


def _exit_now() -> None:
    if _exit_status is None:
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe: the interpreter's own exit reports it, with its status
        return
    os._exit(_exit_status)
