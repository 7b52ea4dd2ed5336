"""What a recorded :class:`~hf_paged.executor.native_program.DecodeProgram` read from the model, checked before
every replay in bulk: each kind of read is one ``map`` over parallel lists (C loops, no Python frame per item),
where a Python loop over the ~970 reads of the default model took ~300 us a step on the Xeon AMX host (2-3% of a
batch-1 step). Anything the fast checks cannot tell apart (a LoRA slot moved between allowed values, a packed
group's member changed) goes to the exact per-item check, which may re-pack a group."""

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
    ``(packed group, its pack)``, the group must stay usable with that pack."""

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
        self._groups = groups
        self._group_objects = [g for g, _ in groups]
        self._packs = [p for _, p in groups]
        # the members' parameters each group's ``usable`` compares (as group.sources has them now)
        members = [(params, src) for g, _ in groups for params, src in zip(g._params, g.sources)]
        self._m_params = [params for params, _ in members]
        self._m_weights = [src[0] for _, src in members]
        self._m_wv = [src[1] for _, src in members]
        self._m_wp = [src[2] for _, src in members]
        self._m_biases = [src[3] for _, src in members]
        self._m_bias_tensors = [src[3] for _, src in members if src[3] is not None]
        self._m_bv = [src[4] for _, src in members if src[3] is not None]
        self._m_bp = [src[5] for _, src in members if src[3] is not None]

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
        if not self._members_unchanged():
            for group, pack in self._groups:  # the exact check, re-packing a group whose member changed
                if not group.usable() or group.pack is not pack:
                    return False
        return _same(map(_pack, self._group_objects), self._packs)

    def _members_unchanged(self) -> bool:
        return (
            _same(map(dict.get, self._m_params, repeat("weight")), self._m_weights)
            and list(map(_version, self._m_weights)) == self._m_wv
            and list(map(_data_ptr, self._m_weights)) == self._m_wp
            and _same(map(dict.get, self._m_params, repeat("bias")), self._m_biases)
            and list(map(_version, self._m_bias_tensors)) == self._m_bv
            and list(map(_data_ptr, self._m_bias_tensors)) == self._m_bp
        )
