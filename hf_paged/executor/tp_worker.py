"""The worker ranks of tensor parallelism: what every rank other than 0 runs (:mod:`hf_paged.executor.multiproc`
is rank 0's side).

A worker joins the process group, loads its shard and builds its executor (errors are exchanged, so every rank
raises the same :class:`~hf_paged.executor.process_group.TensorParallelError`), then serves what rank 0
broadcasts until it broadcasts None: a step's plain data (its forward), a :class:`DraftStep` (a ``self:N`` draft
forward on its shard's first layers), a LoRA adapter change, or a KV-tier message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback

import torch
import torch.distributed as dist

from hf_paged.config import EngineConfig
from hf_paged.executor.executor import UniProcExecutor
from hf_paged.executor.kv_tiers_tp import serve_tier_message
from hf_paged.executor.process_group import TensorParallelError, die_with_parent, init_group, launched
from hf_paged.executor.shard_loading import ModelSource
from hf_paged.executor.tp_lora import LoRAUpdate, apply_lora_update
from hf_paged.model.layers.parallel import agree_min
from hf_paged.spec_decode.draft_model import truncated_view


def worker_config(cfg: EngineConfig) -> EngineConfig:
    """The execution settings every rank runs: the engine's own (quantization, KV dtype, fast step runners: the
    collectives are part of the layers, so a replayed step runs them too), one process each. The speculative
    configuration stays for the sizes it sets (decode buckets' query lengths, equal on every rank); the proposer
    itself is rank 0's."""
    return dataclasses.replace(cfg, tensor_parallel_size=1)


@dataclasses.dataclass
class DraftStep:
    """A ``self:N`` draft forward rank 0 is about to run: every rank runs it on the first ``layers`` layers of its
    shard (their all-reduces and the head's gather need every rank)."""

    layers: int
    batch: list
    tables: dict[int, list[int]]


def _draft_forward(executor: UniProcExecutor, views: dict, msg: DraftStep) -> None:
    view = views.get(msg.layers)
    if view is None:
        view = views[msg.layers] = truncated_view(executor.model, msg.layers)
    executor.runner.draft_logits(msg.batch, executor.runner.attention, msg.tables, view)


def _exchange_status(error: str | None) -> None:
    """Every rank says whether its part went well; all raise the same error if any failed."""
    statuses: list = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, error)
    failed = [(rank, s) for rank, s in enumerate(statuses) if s is not None]
    if failed:
        raise TensorParallelError("; ".join(f"rank {rank}: {s}" for rank, s in failed))


def build_rank(source: ModelSource, cfg: EngineConfig, rank: int, world: int) -> UniProcExecutor:
    """This rank's shard and executor (collective with the other ranks; errors are exchanged, so every rank
    raises the same :class:`TensorParallelError` naming the rank(s) that failed)."""
    error, model = None, None
    try:
        model = source.load_shard(rank, world)
    except Exception as e:  # noqa: BLE001 - reported to every rank
        error = f"loading its shard failed: {type(e).__name__}: {e}"
    _exchange_status(error)
    executor = None
    try:
        executor = UniProcExecutor(model, worker_config(cfg), agree=agree_min)
    except Exception as e:  # noqa: BLE001
        error = f"building its executor (KV pool, kernels) failed: {type(e).__name__}: {e}"
    _exchange_status(error)
    return executor


def run_worker(source: ModelSource, cfg: EngineConfig, rank: int, world: int, init_method: str,
               timeout_s: float, conn=None) -> None:
    """A worker rank: join the group, build its shard and pool, then run every step rank 0 broadcasts until
    it broadcasts None (close) or a collective fails (rank 0 gone)."""
    executor = None
    try:
        device = source.rank_device(rank)
        init_group(rank, world, init_method, timeout_s, device, announce=conn is not None)
        executor = build_rank(source, cfg, rank, world)
        if conn is not None:
            conn.send(("ready", rank))
        views: dict = {}  # self:N draft views of the shard, by N
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                break
            if isinstance(box[0], DraftStep):
                with torch.inference_mode():
                    _draft_forward(executor, views, box[0])
            elif isinstance(box[0], LoRAUpdate):
                apply_lora_update(executor.lora, box[0])  # a failure is rank 0's to report
            elif not serve_tier_message(executor.kv_tiers, box[0], agree_min):
                executor.execute_forward(box[0])
    except BaseException as e:  # noqa: BLE001 - reported to rank 0 where it can still listen
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.send(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise
    finally:
        if executor is not None:
            executor.close()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def spawned_worker(source, cfg, rank, world, init_method, timeout_s, threads, conn) -> None:
    die_with_parent()
    torch.set_num_threads(threads)
    try:
        run_worker(source, cfg, rank, world, init_method, timeout_s, conn)
    except BaseException:  # noqa: BLE001 - already reported through conn
        os._exit(1)
    os._exit(0)  # done: no interpreter teardown (it can race c10d's threads into an abort)


def worker_entry(source, cfg: EngineConfig) -> bool:
    """Under torchrun: on a rank other than 0, serve as a worker until rank 0 closes, then return True (the
    caller exits). On rank 0, or without a launcher, return False at once."""
    found = launched()
    if found is None or found[0] == 0:
        return False
    rank, world, init_method = found
    if world != cfg.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size} but the launcher started WORLD_SIZE={world} processes")
    run_worker(ModelSource.of(source), cfg, rank, world, init_method, cfg.distributed_timeout)
    return True
