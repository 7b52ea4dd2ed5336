"""What a recorded :class:`~hf_paged.executor.native_program.DecodeProgram` read from the model, checked before
every replay in bulk: each kind of read is one ``map`` over parallel lists (C loops, no Python frame per item),
where a Python loop over the ~970 reads of the default model took ~300 us a step on the Xeon AMX host (2-3% of a
batch-1 step). Where the fast check cannot tell (a LoRA slot moved between allowed values) the exact per-item
check decides. A packed group's members are plain tensor reads in ``seen``; the group itself must still hold the
pack the calls read (a changed member makes the recording stale; recording again re-packs the group)."""

from __future__ import annotations

import operator
from itertools import repeat

import torch

_data_ptr = torch.Tensor.data_ptr
_version = operator.attrgetter("_version")
_pack = operator.attrgetter("pack")


def _same(current, recorded: list) -> bool:
    return all(map(operator.is_, current, recorded))


class RecordedReads:
    """``seen``: ``(owner dict, key, object, version, address)`` entries (version and address None for what is
    not a tensor; version None for an inference tensor); ``scalars``: ``(object, attribute, value)``;
    ``lora_checks``: ``(layer, allowed slot)``, a layer's ``lora`` must stay None or that slot; ``groups``:
    ``(packed group, its pack)``, the group must still hold that pack."""

    def __init__(self, seen: list, scalars: list, lora_checks: list, groups: list) -> None:
        objects = [e for e in seen if e[4] is None]
        tensors = [e for e in seen if e[4] is not None]
        self._o_owners, self._o_keys, self._objects = ([e[i] for e in objects] for i in range(3))
        self._t_owners, self._t_keys, self._tensors = ([e[i] for e in tensors] for i in range(3))
        self._ptrs = [e[4] for e in tensors]
        self._versioned = [e[2] for e in tensors if e[3] is not None]
        self._versions = [e[3] for e in tensors if e[3] is not None]
        self._s_objects, self._s_attrs, self._s_values = ([s[i] for s in scalars] for i in range(3))
        self._lora_checks = lora_checks
        self._lora_layers = [layer for layer, _ in lora_checks]
        self._lora_now = [getattr(layer, "lora", None) for layer in self._lora_layers]
        self._groups = [g for g, _ in groups]
        self._packs = [p for _, p in groups]

    def valid(self) -> bool:
        if not _same(map(dict.get, self._o_owners, self._o_keys), self._objects):
            return False
        if not _same(map(dict.get, self._t_owners, self._t_keys), self._tensors):
            return False
        if list(map(_data_ptr, self._tensors)) != self._ptrs or list(map(_version, self._versioned)) != self._versions:
            return False
        if list(map(getattr, self._s_objects, self._s_attrs, repeat(None))) != self._s_values:
            return False
        if not _same(map(getattr, self._lora_layers, repeat("lora"), repeat(None)), self._lora_now):
            for layer, slot in self._lora_checks:  # moved: still fine if None or the allowed slot
                lora = getattr(layer, "lora", None)
                if lora is not None and lora is not slot:
                    return False
        return _same(map(_pack, self._groups), self._packs)
