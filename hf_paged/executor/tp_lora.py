"""LoRA adapters on every rank of a tensor-parallel group.

Each rank holds its own :class:`~hf_paged.lora.manager.LoRAManager` over its shard's linears (adapters cut like
their layers: see its ``parts``). Per-step state needs nothing new: every scheduled sequence's ``lora_int_id``
travels in the step rank 0 broadcasts, and every rank makes the same adapters resident in the same slots because
it sees the same steps. An adapter change (``add_lora`` / ``remove_lora``, or a request naming a new adapter) is
broadcast as a :class:`LoRAUpdate` between steps; every rank applies it and the ranks exchange the outcome, so an
adapter is registered on all ranks or on none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from hf_paged.lora.request import LoRARequest


@dataclass
class LoRAUpdate:
    """An adapter change for every rank: ``op`` "add" (``arg``: the :class:`LoRARequest`) or "remove" (``arg``:
    its ``lora_int_id``)."""

    op: str
    arg: LoRARequest | int


def apply_lora_update(manager, update: LoRAUpdate) -> tuple[object, Exception | None]:
    """Apply ``update`` on this rank (collective: every rank calls it for the same update) and return ``(result,
    error)``: the manager's result, and the error rank 0 raises (its own, or one naming the failed ranks), else None.
    An add that failed on any rank is undone on the ranks where it went through."""
    result, error = None, None
    try:
        result = manager.add(update.arg) if update.op == "add" else manager.remove(update.arg)
    except Exception as e:  # noqa: BLE001 - exchanged with the other ranks, raised on rank 0
        error = e
    statuses: list = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, status) for rank, status in enumerate(statuses) if status is not None]
    if not failed:
        return result, None
    if update.op == "add" and error is None and result:
        manager.remove(update.arg.lora_int_id)
    if error is None:
        name = update.arg.lora_name if isinstance(update.arg, LoRARequest) else f"id {update.arg}"
        error = ValueError(f"LoRA adapter {name}: " + "; ".join(f"rank {rank}: {s}" for rank, s in failed))
    return None, error


class TensorParallelLoRA:
    """Rank 0's face of the group's adapters (the executor's ``lora``): ``add``, ``remove`` and ``list`` as a
    :class:`~hf_paged.lora.manager.LoRAManager`'s, applied on every rank; other attributes are rank 0's manager's."""

    def __init__(self, executor, manager) -> None:
        self._executor = executor
        self.manager = manager

    def add(self, request: LoRARequest) -> bool:
        if not isinstance(request, LoRARequest):
            raise TypeError(f"expected a LoRARequest, got {type(request).__name__}")
        if self.manager.requests.get(request.lora_int_id) == request:
            return False  # every request naming a registered adapter comes here: no collective for it
        return self._executor.update_lora(LoRAUpdate("add", request))

    def remove(self, lora_id: int) -> bool:
        if lora_id not in self.manager.requests:
            return False
        return self._executor.update_lora(LoRAUpdate("remove", lora_id))

    def list(self) -> list[LoRARequest]:
        return self.manager.list()

    def __getattr__(self, name: str):
        return getattr(self.manager, name)  # read-only state (max_loras, slots, ...) as rank 0 holds it
