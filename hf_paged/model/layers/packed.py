"""The model side of packed linears: which of the engine's linear layers run through which pack.

:class:`PackedLinears` gives every CPU fp32/bf16/fp16 :class:`~hf_paged.model.layers.linear.DenseLinear` the
packer of its dtype (:mod:`hf_paged.kernels.cpu.packed_linear`); the layer uses its pack inside engine forwards only.
:class:`PackedGroup` packs sibling projections that read the same input (q/k/v, gate/up) as one weight, for the
fused decoder layers.
"""

from __future__ import annotations

import logging

import torch

from hf_paged.model.layers.linear import DenseLinear
from hf_paged.model.layers.parallel import is_shard, rank0_value
from hf_paged.kernels.cpu.packed_linear import (
    CANDIDATES, KIND_NAMES, PACKERS, OneDnnPackedWeight, PackedWeight, UpcastPackedWeight, available, fastest_kind,
)

logger = logging.getLogger(__name__)


class PackedGroup:
    """Sibling linears that read the same input (q/k/v, gate/up) packed as one weight ``[sum(out), in]``.

    One GEMM instead of two or three: at the row counts of a CPU decode step a small GEMM pays a fixed cost per
    call and reaches a lower FLOP rate than a wider one (default model, fp32, Zen 4: q+k+v at one row 56 us
    apart against 31 us fused; at 64 rows 364 us against 342 us). :meth:`linear` returns the members' outputs
    side by side (``split`` them by :attr:`sizes`); a member whose weight or bias changed (optimizer step,
    ``load_state_dict``, a replaced tensor) makes the group re-pack on its next call.
    """

    def __init__(self, modules: list[torch.nn.Linear], packer) -> None:
        self.modules = modules
        self._params = [m._parameters for m in modules]  # nn.Linear keeps weight and bias here
        self.sizes = [m.out_features for m in modules]
        self._packer = packer
        self._pack()

    def _sources(self) -> list:
        # objects, versions and addresses (``param.data = t`` keeps the object and its version)
        return [(m.weight, m.weight._version, m.weight.data_ptr(), m.bias, None if m.bias is None else m.bias._version,
                 None if m.bias is None else m.bias.data_ptr()) for m in self.modules]

    def _pack(self) -> None:
        self.sources = self._sources()
        with torch.inference_mode(False):  # built during an engine step: a normal tensor, with a version counter
            weights = [m.weight.detach() for m in self.modules]
            stacked = getattr(self._packer, "stacked", None)  # packs the members in place of their concatenation
            self.pack = (stacked and stacked(weights)) or self._packer(torch.cat(weights))
            if all(m.bias is None for m in self.modules):
                self.bias = None
            else:  # a member without bias adds zeros: exact
                self.bias = torch.cat([
                    m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in self.modules
                ])

    def usable(self) -> bool:
        """Whether the members still fit one pack (same CPU dtype and input width), re-packing if they changed."""
        for params, (w, wv, wp, b, bv, bp) in zip(self._params, self.sources):  # every call: plain dict reads
            if params["weight"] is not w or w._version != wv or w.data_ptr() != wp or params.get("bias") is not b or (
                b is not None and (b._version != bv or b.data_ptr() != bp)
            ):
                break
        else:
            return True
        first = self.modules[0].weight
        if any(m.weight.dtype != first.dtype or m.weight.device.type != "cpu" or m.weight.dim() != 2
               or m.weight.shape[1] != first.shape[1] or m.weight.is_inference()
               or (m.bias is not None and m.bias.is_inference()) for m in self.modules):
            return False
        self._pack()
        return True

    @property
    def dtype(self) -> torch.dtype:
        return self.modules[0].weight.dtype

    def linear(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, sum(sizes)]
        return self.pack.linear(x, self.bias)


class _Packer:
    """Makes a layer's pack of one kind for weights of one dtype (``DenseLinear.packer``)."""

    __slots__ = ("kind", "dtype", "_make")

    def __init__(self, kind: str, dtype: torch.dtype) -> None:
        self.kind, self.dtype, self._make = kind, dtype, PACKERS[kind]

    def __call__(self, weight: torch.Tensor):
        return self._make(weight)


class PackedLinears:
    """Packs the weight of every fp32/bf16 CPU :class:`~hf_paged.model.layers.linear.DenseLinear` of ``model``
    (the engine's own linears: :class:`~hf_paged.model.layers.linear.OwnedLinears` made them); those layers use
    their pack inside engine forwards.

    Args:
        model: The model whose engine linears get a packer.
        kind: "auto" (per dtype, the fastest of plain ``F.linear`` and the packings that pass their probe
            here, timed once at one weight shape), "any" (the fastest packing even if ``F.linear`` is as
            fast), or "mkl", "onednn", "upcast" to use that packing where it works (dtypes it cannot pack stay
            unpacked).
    """

    def __init__(self, model: torch.nn.Module, kind: str = "auto") -> None:
        if kind not in ("auto", "any", *PACKERS):
            raise ValueError(f"packing kind must be 'auto', 'any', {KIND_NAMES}, got {kind!r}")
        self._layers: list[DenseLinear] = []
        self._groups: dict[tuple, PackedGroup | None] = {}
        self.kinds: dict[torch.dtype, str] = {}  # dtype -> packing kind in use ("torch": not packed)
        nbytes = 0
        self._shard = is_shard(model)  # a tensor-parallel shard packs as rank 0 chose
        for module in model.modules():
            if type(module) is not DenseLinear or module.weight.device.type != "cpu":
                continue
            w = module.weight
            if w.is_inference() or (module.bias is not None and module.bias.is_inference()):
                # made under torch.inference_mode: no version counter, so an in-place change could not be seen
                # and a pack would go stale silently; these keep F.linear
                continue
            packer = self._packer(w, kind)
            if packer is None:
                continue
            # packed on first use: the members of a packed group (q/k/v, gate/up) never need a pack of their own
            module.set_packer(packer, pack_now=False)
            nbytes += w.numel() * w.element_size()
            self._layers.append(module)
        logger.info(
            "pre-packed %d linear layers (%.0f MiB of weights; %s)", len(self._layers), nbytes / 2**20,
            ", ".join(f"{str(d).removeprefix('torch.')}: {k}" for d, k in self.kinds.items()) or "none",
        )

    def _packer(self, weight: torch.Tensor, kind: str) -> _Packer | None:
        dtype = weight.dtype
        if dtype not in self.kinds:
            if kind in ("auto", "any"):
                # timed on each rank alone: a tensor-parallel shard packs as rank 0 chose
                fastest = fastest_kind(dtype, *weight.shape, include_torch=kind == "auto")
                self.kinds[dtype] = rank0_value(fastest) if self._shard else fastest
            else:
                self.kinds[dtype] = kind if kind in CANDIDATES.get(dtype, ()) and available(kind, dtype) else "torch"
        chosen = self.kinds[dtype]
        return None if chosen == "torch" else _Packer(chosen, dtype)

    @property
    def packed_kinds(self) -> dict[torch.dtype, str]:
        """dtype -> packing kind, for the dtypes whose linears are packed."""
        return {d: k for d, k in self.kinds.items() if k != "torch"}

    def __len__(self) -> int:
        return len(self._layers)

    def current_pack(self, module: torch.nn.Module):
        """``module``'s pack for its current weight (packed again if the weight changed, as its forward would),
        or None where it has none: not a layer packed here, or its weight no longer fits the packing."""
        return module.current_pack() if type(module) is DenseLinear and module.packer is not None else None

    def group(self, parent: torch.nn.Module, names: tuple[str, ...]) -> PackedGroup | None:
        """The children ``names`` of ``parent`` packed as one weight (built on first request, then kept), or None
        where they cannot share one: not all packed here, different dtypes or input widths.

        Building it drops the members' own packs (they would only duplicate the memory); a member called on its
        own later (outside the fused path) packs itself again on that call.
        """
        key = (id(parent), names)
        if key in self._groups:
            group = self._groups[key]
            if group is None or any(getattr(parent, n, None) is not m for n, m in zip(names, group.modules)):
                if group is None:
                    return None
                del self._groups[key]  # a member module was replaced: group the new ones
                return self.group(parent, names)
            return group if group.usable() else None
        modules = [getattr(parent, n, None) for n in names]
        group = None
        if all(type(m) is DenseLinear and m.packer is not None for m in modules):
            w0 = modules[0].weight
            if all(m.weight.dtype == w0.dtype and m.weight.shape[1] == w0.shape[1] for m in modules):
                group = PackedGroup(modules, PACKERS[self.kinds[w0.dtype]])
                for m in modules:
                    m.drop_pack()
        self._groups[key] = group
        return group

    def remove(self) -> None:
        for layer in self._layers:
            layer.set_packer(None, pack_now=False)
        self._layers.clear()
        self._groups.clear()
