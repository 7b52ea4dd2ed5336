"""Process tuning for the CPU engine, applied by the ``hf-paged`` launcher before torch starts.

The launcher computes a tuned environment before anything loads torch. OpenMP reads its settings when its
runtime loads (with torch), so those are set in this process; the dynamic loader reads ``LD_PRELOAD`` only
when a process starts, so a preload makes the launcher re-execute itself once with the tuned environment:

- threads (offline commands only: ``batch``, ``generate``, ``bench`` but not ``bench serve`` or ``bench replicas``, ``env``; see
  ``BINDING_COMMANDS``): ``OMP_NUM_THREADS`` = the physical cores this process may run on, ``OMP_PLACES`` = one
  logical CPU of each of those cores (never two SMT siblings), ``OMP_PROC_BIND=close``: one bound OpenMP thread
  per core;
- allocator: tcmalloc (or jemalloc) preloaded when the machine has one; it is never required.

Whatever the user has set wins: a variable that is already set is left alone, and ``HF_PAGED_TUNE=0`` turns the
whole thing off. The measured effect of each setting is in docs/cpu.md and docs/performance_log.md. This module imports nothing
heavy (no torch), so the decision costs nothing before the re-exec. The command's garbage collection pause
and quick exit (:mod:`hf_paged.cli.lifetime`) are switched with the rest.
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass, field

TUNE_VAR = "HF_PAGED_TUNE"  # "0": off; "applied": this process is the re-executed one
ALLOCATOR_VAR = "HF_PAGED_ALLOCATOR"  # explicit path of an allocator library to preload
BINDING_VARS = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
ALLOCATOR_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libjemalloc.so.2")
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
    "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
)
_ALLOCATOR_MARKERS = ("tcmalloc", "jemalloc", "mimalloc")


@dataclass
class Tuning:
    """The environment a tuned process gets, and one line per change for the log."""

    env: dict[str, str]
    changes: list[str] = field(default_factory=list)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def core_cpus(cpus: set[int] | None = None, sysfs: str = "/sys/devices/system/cpu") -> list[int]:
    """One logical CPU per physical core among ``cpus`` (default: this process's affinity), lowest first.

    SMT siblings share ``(physical_package_id, core_id)``; the lowest-numbered sibling represents its core. Where
    the topology cannot be read every CPU counts as its own core.
    """
    if cpus is None:
        cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    seen: dict[tuple[int, int], int] = {}
    for cpu in sorted(cpus):
        package = _read_int(f"{sysfs}/cpu{cpu}/topology/physical_package_id")
        core = _read_int(f"{sysfs}/cpu{cpu}/topology/core_id")
        key = (package, core) if package is not None and core is not None else (-1, cpu)
        seen.setdefault(key, cpu)
    return sorted(seen.values())


def find_allocator(environ: dict[str, str], dirs: tuple[str, ...] = LIBRARY_DIRS) -> str | None:
    """Path of tcmalloc/jemalloc to preload: ``$HF_PAGED_ALLOCATOR`` if it names a file, else the first found."""
    explicit = environ.get(ALLOCATOR_VAR)
    if explicit:
        if not os.path.isfile(explicit):
            raise ValueError(f"{ALLOCATOR_VAR}={explicit!r}: no such file (give the path of libtcmalloc or "
                             "libjemalloc, or unset it)")
        return explicit
    for name in ALLOCATOR_NAMES:
        for d in dirs:
            hits = sorted(glob.glob(os.path.join(d, name)))
            if hits:
                return hits[0]
    return None


def tuned_environment(environ: dict[str, str], *, bind: bool = True, allocator: bool = True,
                      cpus: list[int] | None = None, library_dirs: tuple[str, ...] = LIBRARY_DIRS) -> Tuning:
    """The tuned copy of ``environ``; settings the user already made are kept as they are."""
    env = dict(environ)
    changes: list[str] = []
    cores = core_cpus() if cpus is None else list(cpus)
    if bind and cores and not any(env.get(v) for v in BINDING_VARS):
        if not env.get("OMP_NUM_THREADS"):
            env["OMP_NUM_THREADS"] = str(len(cores))
            changes.append(f"OMP_NUM_THREADS={len(cores)}")
        env["OMP_PLACES"] = ",".join("{%d}" % c for c in cores)
        env["OMP_PROC_BIND"] = "close"
        changes.append(f"OMP_PLACES={env['OMP_PLACES']} OMP_PROC_BIND=close")
    preload = env.get("LD_PRELOAD", "")
    if allocator and not any(m in preload for m in _ALLOCATOR_MARKERS):
        path = find_allocator(env, library_dirs)
        if path:
            env["LD_PRELOAD"] = f"{path}:{preload}" if preload else path
            changes.append(f"LD_PRELOAD={path}")
    return Tuning(env, changes)


# Commands that bind threads. Binding pins the process's main thread to the first core too, and every thread and
# child process it starts inherits that: a server thread would share the engine's first core, and `bench serve`'s
# server child would get one core (measured: HTTP throughput at 64 clients fell from 185 to 110 tok/s); `bench
# replicas`' Ray workers would inherit the binding too.
BINDING_COMMANDS = ("batch", "generate", "bench", "env")


def binds_threads(argv: list[str]) -> bool:
    """Whether the ``hf-paged`` command in ``argv`` runs with bound threads (offline work in one process)."""
    words = [a for a in argv if not a.startswith("-")]
    if not words or words[0] not in BINDING_COMMANDS:
        return False
    return not (words[0] == "bench" and words[1:2] in (["serve"], ["replicas"]))


def ends_after_start_up(argv: list[str]) -> bool:
    """Whether the command in ``argv`` ends once its work is done (``generate``, ``batch``), unlike a server."""
    words = [a for a in argv if not a.startswith("-")]
    return bool(words) and words[0] in ("generate", "batch")


def enabled(environ: dict[str, str]) -> bool:
    """Whether to tune this process's environment (not when switched off, nor in the re-executed process)."""
    return environ.get(TUNE_VAR, "1").strip().lower() != "applied" and not switched_off(environ)


def switched_off(environ: dict[str, str]) -> bool:
    """``HF_PAGED_TUNE=0``: no process tuning at all (ValueError for a value that is neither on nor off)."""
    value = environ.get(TUNE_VAR, "1").strip().lower()
    if value not in ("0", "off", "false", "no", "applied", "1", "on", "true", "yes", ""):
        raise ValueError(f"{TUNE_VAR}={environ[TUNE_VAR]!r}: use 1 (tune the process, the default) or 0 (leave it)")
    return value in ("0", "off", "false", "no")


# The OpenMP runtimes whose settings apply when they load; one already in the process has read its settings.
_OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")


def openmp_loaded(maps: str = "/proc/self/maps") -> bool:
    """Whether an OpenMP runtime is loaded in this process already (True where that cannot be read)."""
    try:
        with open(maps) as f:
            text = f.read()
    except OSError:
        return True
    return any(name in text for name in _OPENMP_LIBRARIES)


def tune_process(argv: list[str], *, bind: bool = True, environ=None, execve=os.execve,
                 openmp_is_loaded=openmp_loaded) -> None:
    """Tune this process for ``python -m hf_paged.cli argv``, once: the OpenMP settings go into ``environ``
    (default ``os.environ``; OpenMP reads them when torch loads it), and a preloaded allocator (or an OpenMP
    runtime that has read its settings already) re-executes the process with the tuned environment instead.

    Does nothing when torch is already imported (too late for OpenMP settings), when tuning is off, or when
    this process is already the tuned one.
    """
    target = os.environ if environ is None else environ
    current = dict(target)
    if "torch" in sys.modules or not enabled(current):
        return
    tuning = tuned_environment(current, bind=bind)
    if not tuning.changes:
        return
    tuning.env[TUNE_VAR] = "applied"
    tuning.env["HF_PAGED_TUNED_WITH"] = "; ".join(tuning.changes)
    if tuning.env.get("LD_PRELOAD") == current.get("LD_PRELOAD") and not openmp_is_loaded():
        target.update({k: v for k, v in tuning.env.items() if current.get(k) != v})  # no re-exec needed
        return
    sys.stdout.flush()
    sys.stderr.flush()
    execve(sys.executable, [sys.executable, "-m", "hf_paged.cli", *argv], tuning.env)
