"""Tensor parallelism over ``torch.distributed``: the rank-0 executor and the worker ranks.

Rank 0 is the engine's process: it runs the scheduler and, every step, broadcasts the step's plain data
(:class:`~hf_paged.core.scheduler_output.SchedulerOutput` without the sampling parameters: workers only run
the forward) to the other ranks, then runs the step itself. Every rank holds its shard of the model
(:mod:`hf_paged.executor.tensor_parallel`) and a KV pool for its own KV heads; the row-parallel layers
all-reduce, the LM head's slices are gathered on rank 0, and only rank 0 samples.

Ranks are processes the engine spawns on this machine, or, under ``torchrun`` (``WORLD_SIZE`` in the
environment), the processes torchrun started, possibly on several machines: rank 0 drives, the others call
:func:`~hf_paged.executor.tp_worker.run_worker`. The process group is ``init_process_group`` with gloo on CPU and NCCL on CUDA.

Faults: a rank that dies or raises makes rank 0's next collective fail (or its liveness check, before each
step or in :meth:`~TensorParallelExecutor.check_health`); the executor then logs the details once, sets its
``failure`` (one short line for clients: which rank exited, and how), fails the step with a
:class:`TensorParallelError`, shuts every rank down, and fails every later step at once. A worker whose rank 0 dies gets a connection error and exits; the
workers the engine spawns also die with their parent (Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import multiprocessing.connection
import os
import re
import signal
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_paged.config import EngineConfig
from hf_paged.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from hf_paged.executor.executor import Executor, ExecutorSetup, UniProcExecutor
from hf_paged.executor.kv_tiers_tp import ShardedTierStore
from hf_paged.executor.process_group import (  # noqa: F401 - TensorParallelError re-exported
    TensorParallelError, free_port, init_group, launched, rank_places,
)
from hf_paged.executor.shard_loading import ModelSource
from hf_paged.executor.tensor_parallel import check_shardable
from hf_paged.executor.tp_lora import LoRAUpdate, TensorParallelLoRA, apply_lora_update
from hf_paged.executor.tp_worker import DraftStep, build_rank, spawned_worker
from hf_paged.model.layers.parallel import agree_min

logger = logging.getLogger(__name__)


def check_config(cfg: EngineConfig) -> None:
    """ValueError naming what tensor parallelism cannot combine with (the rest composes)."""
    if cfg.decode_runner == "inductor":
        raise ValueError("decode_runner='inductor' cannot be used with tensor_parallel_size > 1: the compiled graph "
                         "would break at every collective; use 'auto', 'native', 'static' or 'cuda_graphs'")


class TensorParallelExecutor(Executor):
    """Rank 0 of a tensor-parallel group: spawns the other ranks (or joins torchrun's), holds its own shard,
    and runs every step on all ranks.

    Args:
        source: The model (a transformers model on the CPU, or a folder path, or a :class:`ModelSource`).
        cfg: The engine configuration (``tensor_parallel_size`` > 1).
    """

    def __init__(self, source, cfg: EngineConfig) -> None:
        check_config(cfg)
        self.world = world = cfg.tensor_parallel_size
        self.source = source = ModelSource.of(source)
        if source.device == "cuda" and cfg.decode_runner == "auto":
            # CUDA graphs with the collectives captured inside have not run on a GPU yet (our machines have none):
            # eager steps by default there; decode_runner="cuda_graphs" asks for them
            cfg = dataclasses.replace(cfg, enforce_eager=True)
        self.timeout_s = cfg.distributed_timeout
        self.processes: list = []
        self.conns: list = []
        self.failed: str | None = None
        self.inner: UniProcExecutor | None = None
        self._threads = None  # rank 0's threads in its own work, where it shares the cores with spawned ranks
        check_shardable(source.skeleton(), world)  # a clear error before any process starts
        found = launched()
        if found is not None:
            rank, launched_world, init_method = found
            if rank != 0 or launched_world != world:
                raise ValueError(f"under a launcher (RANK={rank}, WORLD_SIZE={launched_world}) the engine runs on rank 0 "
                                 f"with tensor_parallel_size=WORLD_SIZE; got tensor_parallel_size={world}")
        else:
            # MASTER_ADDR / MASTER_PORT, as torch.distributed reads them, where set; else a free loopback port
            addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
            init_method = f"tcp://{addr}:{os.environ.get('MASTER_PORT') or free_port()}"
            self._spawn(source, cfg, init_method)
        try:
            if self.processes:  # spawned here: host the store, watch the workers until they joined it
                self._store = self._host_store(init_method)
                init_group(0, world, init_method, self.timeout_s, source.rank_device(0), self._store, self._wait_joined)
            else:
                init_group(0, world, init_method, self.timeout_s, source.rank_device(0))
            with _thread_count(self._threads):
                self.inner = build_rank(source, cfg, 0, world)
            self._wait_ready()
        except BaseException as e:
            self._shutdown(broadcast=False)
            if isinstance(e, TensorParallelError):
                raise TensorParallelError(self._worker_errors() or str(e)) from None
            raise
        self.model = self.inner.model
        self.lora = TensorParallelLoRA(self, self.inner.lora) if self.inner.lora is not None else None
        self.runner = self.inner.runner  # rank 0's model runner: for white-box tests, not part of the contract
        self.max_model_len = self.inner.max_model_len
        self.num_blocks = self.inner.num_blocks
        self.num_host_blocks = self.inner.num_host_blocks
        # rank 0's; every rank runs the same tier moves on its own host tier, and reads its own shard's files
        self.kv_tiers = self.inner.kv_tiers
        if self.kv_tiers is not None and self.kv_tiers.has_disk:
            self.kv_tiers = ShardedTierStore(self.kv_tiers, self._collective, self._broadcast, agree_min,
                                             lambda: self.failed is not None)
        self.comm_seconds = 0.0  # time spent broadcasting steps (the all-reduces are inside the forward)
        # an engine never closed (a script that just ends) still tells its workers to stop at exit
        self._at_exit = weakref.finalize(self, TensorParallelExecutor._stop_workers, self.processes, True)

    @staticmethod
    def _stop_workers(processes, broadcast: bool) -> None:
        """Tell every rank to stop (``broadcast``: while the group still works), then end the spawned ones:
        5 s to exit on their own, killed after that."""
        if broadcast and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.broadcast_object_list([None], src=0)
        deadline = time.monotonic() + 5.0
        for proc in processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)

    # -- start --------------------------------------------------------------------------------------
    def _spawn(self, source: ModelSource, cfg: EngineConfig, init_method: str) -> None:
        ctx = mp.get_context("spawn")
        threads = self._threads = max(1, torch.get_num_threads() // self.world)
        for rank in range(1, self.world):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=spawned_worker, name=f"hf-paged-tp{rank}", daemon=True,
                               args=(source, cfg, rank, self.world, init_method, self.timeout_s, threads, child))
            with rank_places(rank, self.world):
                proc.start()
            child.close()
            self.processes.append(proc)
            self.conns.append(parent)

    def _host_store(self, init_method: str):
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        try:
            return dist.TCPStore(host, int(port), self.world, is_master=True,
                                 timeout=datetime.timedelta(seconds=self.timeout_s), wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - the port is taken, the address is not ours
            raise TensorParallelError(f"rank 0: cannot listen on {host}:{port}: {type(e).__name__}: {e}") from e

    def _wait_joined(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        for rank, proc in enumerate(self.processes, start=1):
            key = f"hf_paged/joined/{rank}"
            while not self._store.check([key]):
                if not proc.is_alive():
                    raise TensorParallelError(
                        f"rank {rank} exited (exit code {proc.exitcode}) before joining the group; its error is above. "
                        "A script that builds a tensor-parallel engine must do it under if __name__ == '__main__': "
                        "spawned ranks import the script again"
                    )
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"rank {rank} did not join the group within {self.timeout_s:.0f} s")
                time.sleep(0.02)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        waiting = dict(enumerate(self.conns, start=1))
        while waiting:
            for conn in multiprocessing.connection.wait(list(waiting.values()), timeout=max(0.0, deadline - time.monotonic())):
                msg = conn.recv()
                if msg[0] != "ready":
                    raise TensorParallelError(f"rank {msg[1]}: {msg[2]}")
                waiting.pop(msg[1])
            if time.monotonic() > deadline:
                raise TensorParallelError(f"ranks {sorted(waiting)} were not ready within {self.timeout_s:.0f} s")

    def _worker_errors(self) -> str:
        found = []
        for conn in self.conns:
            with contextlib.suppress(Exception):
                while conn.poll(0.5):
                    msg = conn.recv()
                    if msg[0] == "error":
                        found.append(f"rank {msg[1]}: {msg[2]}")
        return "; ".join(found)

    # -- steps --------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.failed is not None:
            raise TensorParallelError(f"the tensor-parallel engine is shut down: {self.failure}")
        for rank, proc in enumerate(self.processes, start=1):
            if not proc.is_alive():
                how = _exit_text(proc.exitcode)
                self._fail(f"a tensor-parallel worker exited (rank {rank}, {how})", f"rank {rank} exited ({how})")

    def check_health(self) -> str | None:
        if self.failed is None:
            with contextlib.suppress(TensorParallelError):  # recorded in self.failure (and logged once)
                self._check_alive()
        return self.failure

    def _fail(self, summary: str, why: str, cause: BaseException | None = None):
        """The group cannot go on: log ``why`` (with what the workers reported) once, shut every rank down, and
        raise. ``summary`` is the short line clients see (:attr:`failure`)."""
        reported = self._worker_errors()
        self.failed = f"{why}{'; ' + reported if reported else ''}"
        self.failure = summary
        logger.error("tensor parallelism: %s; shutting every rank down", self.failed)
        self._shutdown(broadcast=False)
        raise TensorParallelError(f"the tensor-parallel engine failed and is shut down: {summary}") from cause

    def describe(self) -> ExecutorSetup:
        """Rank 0's part (every rank built the same from the same settings, over its own shard)."""
        return self.inner.describe()

    def _broadcast(self, message) -> None:
        started = time.perf_counter()
        dist.broadcast_object_list([message], src=0)
        self.comm_seconds += time.perf_counter() - started

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        def step() -> ModelRunnerOutput:
            self._broadcast(dataclasses.replace(out, new_sequences=[]))
            with _thread_count(self._threads):
                return self.inner.execute_model(out)

        return self._collective(step)

    def _collective(self, run):
        """``run()`` (which meets the workers); a failure there fails the whole group, logged once."""
        self._check_alive()
        try:
            return run()
        except TensorParallelError:
            raise
        except Exception as e:  # noqa: BLE001 - the ranks may be out of step now: the group cannot go on
            self._collective_failed(e)

    def update_lora(self, update: LoRAUpdate):
        """Apply an adapter change on every rank (:mod:`hf_paged.executor.tp_lora`); raises rank 0's error, or
        one naming the ranks where it failed (then no rank keeps the adapter)."""
        self._check_alive()
        try:
            self._broadcast(update)
            result, error = apply_lora_update(self.inner.lora, update)
        except Exception as e:  # noqa: BLE001 - a collective broke: the group cannot go on
            self._collective_failed(e)
        if error is not None:
            raise error
        return result

    def _collective_failed(self, e: Exception):
        # a peer's death shows as a broken connection first: give its process a moment to be seen dead
        deadline = time.monotonic() + 2.0
        while self.processes and all(p.is_alive() for p in self.processes) and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = [f"rank {r}, {_exit_text(p.exitcode)}" for r, p in enumerate(self.processes, 1) if not p.is_alive()]
        summary = (f"a tensor-parallel worker exited ({'; '.join(dead)})" if dead
                   else "a tensor-parallel collective failed")
        self._fail(summary, f"{summary}: {_first_line(e)}", e)

    def add_proposer(self, key: str, spec) -> None:
        if spec.method == "eagle":  # its logits are the target's lm_head, whose vocabulary shards span the ranks
            raise NotImplementedError("EAGLE-1 heads (method 'eagle') run on one process; tensor-parallel engines "
                                      "support 'ngram', 'draft_model' and 'eagle3'")
        # ngram, a separate draft model or an EAGLE-3 head: rank 0's alone (the head reads the hidden states rank 0
        # captures: every rank holds the whole hidden state between decoder layers; its lm_head is its own)
        if spec.self_draft_layers is None:
            self.inner.add_proposer(key, spec)
            return
        layers = spec.self_draft_layers

        def announce(batch, tables) -> None:  # every rank runs the draft forward on its shard's first layers
            self._broadcast(DraftStep(layers, batch, {item.seq_id: list(tables[item.seq_id]) for item in batch}))

        self.inner.add_proposer(key, spec, announce)

    def has_proposer(self, key: str) -> bool:
        return self.inner.has_proposer(key)

    def weights_changed(self) -> None:
        pass

    @property
    def watches_weights(self) -> bool:
        return False

    # -- end ----------------------------------------------------------------------------------------
    def _shutdown(self, broadcast: bool) -> None:
        self._stop_workers(self.processes, broadcast)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        if self.failed is None and (self.processes or dist.is_initialized()):
            self._shutdown(broadcast=True)
        self._at_exit.detach()


@contextlib.contextmanager
def _thread_count(threads: int | None):
    """Run with ``threads`` intra-op threads (None: as is), giving the calling thread its own count back after: the
    count is per OS thread, and the engine may be built in one thread and stepped in another (the server's loop)."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _exit_text(code: int | None) -> str:
    """How a worker process ended, in words: "killed by SIGKILL", "exit code 1"."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _first_line(error: BaseException) -> str:
    """The first sentence of a collective's error without the library's source location (gloo starts its
    messages with ``[/path/to/pair.cc:537]``), at most 160 characters."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0][:160]
