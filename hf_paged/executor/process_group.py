"""The process side of tensor parallelism: joining the group, the ranks' CPUs, what a launcher set."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import re
import signal
import socket

import torch
import torch.distributed as dist


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed: the engine's ranks are shut down and every later step fails."""


def init_group(rank: int, world: int, init_method: str, timeout_s: float, device: torch.device,
                store=None, wait_joined=None, announce: bool = False) -> None:
    """``init_process_group`` (gloo on CPU, NCCL on CUDA). Ranks the engine spawned meet at rank 0's TCP store
    (``store``) and each says it joined (``announce``) before the group forms, so rank 0 (``wait_joined``:
    waits for them, watching the processes) fails fast when one dies on the way instead of waiting out the
    timeout. Under torchrun every rank goes through ``init_method``."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL collectives (and object broadcasts) run on the rank's own GPU
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if announce:  # a spawned worker: join rank 0's store, say so
            host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
            store = dist.TCPStore(host, int(port), world, is_master=False, timeout=timeout)
            store.set(f"hf_paged/joined/{rank}", "1")
        if wait_joined is not None:
            wait_joined()
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    except TensorParallelError:
        raise
    except Exception as e:  # noqa: BLE001
        raise TensorParallelError(f"rank {rank}: joining the process group at {init_method} failed: {type(e).__name__}: {e}") from e


def die_with_parent() -> None:
    with contextlib.suppress(Exception):  # Linux only: SIGKILL this process when its parent dies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def rank_places(rank: int, world: int):
    """While a worker starts: where the ``hf-paged`` launcher bound OpenMP threads to a list of places
    (``OMP_PLACES={0},{1},...``), the worker gets its own share of them, as its places and as the CPU mask it
    starts with (a child inherits the mask of the thread that starts it, which OpenMP bound to rank 0's
    first core; without this every rank would crowd onto that core)."""
    parts = re.findall(r"\{([0-9,]+)\}", os.environ.get("OMP_PLACES", ""))
    if len(parts) < world or not hasattr(os, "sched_setaffinity"):
        yield
        return
    share = parts[rank * len(parts) // world : (rank + 1) * len(parts) // world]
    cpus = {int(c) for part in share for c in part.split(",")}
    saved = {k: os.environ.get(k) for k in ("OMP_PLACES", "OMP_NUM_THREADS")}
    mask = os.sched_getaffinity(0)
    os.environ["OMP_PLACES"] = ",".join("{%s}" % p for p in share)
    os.environ["OMP_NUM_THREADS"] = str(len(share))
    try:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, mask)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched() -> tuple[int, int, str] | None:
    """(rank, world, init method) when torchrun (or a similar launcher) started this process, else None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), f"tcp://{addr}:{port}"
