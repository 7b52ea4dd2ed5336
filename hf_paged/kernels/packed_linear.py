"""Pre-packed ``nn.Linear`` weights for CPU engine steps (MKL's packed sgemm, or oneDNN's packed linear).

A plain ``F.linear`` on CPU re-packs (reorders) the whole weight matrix on every call. At the batch sizes of
a decode step (tens of rows) that is a large part of the matmul. Packing each weight once makes the model's
matmuls faster at every row count:

- ``"mkl"`` (fp32): ``cblas_sgemm_pack`` once, ``cblas_sgemm_compute`` per call; the kernel ``F.linear``
  itself uses, so results are bitwise equal except for tiny row counts (``F.linear`` then takes a
  matrix-vector path). ~1.1-1.5x on an Intel Cooper Lake host.
- ``"onednn"`` (fp32 and bf16): ``mkldnn._reorder_linear_weight`` once, ``mkldnn._linear_pointwise`` per
  call. bf16 results are bitwise equal to ``F.linear`` (which runs the same oneDNN kernel); fp32 differs from
  MKL in the last bits (a different summation order). On an AMD EPYC (Zen 4) host, where MKL's sgemm reaches
  only ~60-110 GFLOP/s on 2 cores, oneDNN fp32 is 1.3-2x faster than ``F.linear``.

For fp32 the default (``kind="auto"``) times both on one of the model's weight shapes and keeps the faster.

:class:`PackedLinears` swaps the ``forward`` of every plain fp32/bf16 ``nn.Linear`` of a model for one that uses
the packed weight *only inside an engine forward* (``attention.engine_forward``) without autograd; any other
call (training, a plain forward) runs the original ``forward``. A weight changed in place (optimizer step,
``load_state_dict``) or replaced is re-packed on its next use. :meth:`PackedLinears.remove` restores the
modules. The packed copies cost about as much memory as the weights.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
_lib: ctypes.CDLL | None = None
_tried = False


def _mkl() -> ctypes.CDLL | None:
    """libtorch_cpu with MKL's packed sgemm symbols, or None (another BLAS, or not exported)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        get_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except (OSError, AttributeError):
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    get_size.restype = ctypes.c_size_t
    get_size.argtypes = [i, i, i, i]
    pack.restype = None
    pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
    compute.restype = None
    compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
    _lib = lib
    return _lib


def available(kind: str = "any") -> bool:
    """Whether packing ``kind`` ("mkl", "onednn" or "any") works with this torch build."""
    if kind == "mkl":
        return _mkl() is not None
    if kind == "onednn":
        return _onednn()
    return _mkl() is not None or _onednn()


def _onednn() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedWeight:
    """One fp32 weight ``[out_features, in_features]`` packed as MKL's B operand of ``x @ W^T``."""

    kind = "mkl"

    def __init__(self, weight: torch.Tensor) -> None:
        lib = _mkl()
        assert lib is not None and weight.dtype == torch.float32 and weight.dim() == 2
        self.source = weight
        self.version = weight._version
        w = weight.detach().contiguous()
        self.n, self.k = w.shape
        nbytes = lib.cblas_sgemm_pack_get_size(_B_MATRIX, 64, self.n, self.k)
        self.buffer = torch.empty(-(-nbytes // 4), dtype=torch.float32)
        lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, 64, self.n, self.k, 1.0, w.data_ptr(), self.k, self.buffer.data_ptr())

    def stale(self, weight: torch.Tensor) -> bool:
        return weight is not self.source or weight._version != self.version

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [..., k] -> [..., n]
        x2 = x.reshape(-1, self.k).contiguous()
        y = torch.empty(x2.shape[0], self.n, dtype=torch.float32)
        _lib.cblas_sgemm_compute(
            _ROW_MAJOR, _NO_TRANS, _PACKED, x2.shape[0], self.n, self.k, x2.data_ptr(), self.k,
            self.buffer.data_ptr(), self.k, 0.0, y.data_ptr(), self.n,
        )
        return y.view(*x.shape[:-1], self.n)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.matmul(x)
        return y if bias is None else y.add_(bias)


class OneDnnPackedWeight:
    """One fp32 or bf16 weight reordered once into oneDNN's blocked layout for ``x @ W^T (+ b)``."""

    kind = "onednn"

    def __init__(self, weight: torch.Tensor) -> None:
        assert weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
        self.source = weight
        self.version = weight._version
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)

    def stale(self, weight: torch.Tensor) -> bool:
        return weight is not self.source or weight._version != self.version

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")


_PACKERS = {"mkl": PackedWeight, "onednn": OneDnnPackedWeight}


def fastest_fp32_kind(out_features: int, in_features: int, rows: int = 32, reps: int = 8) -> str | None:
    """Time MKL and oneDNN packed fp32 matmuls on one weight shape; the faster kind (None if neither works)."""
    kinds = [k for k in ("mkl", "onednn") if available(k)]
    if len(kinds) < 2:
        return kinds[0] if kinds else None
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    best: tuple[float, str] | None = None
    for kind in kinds:
        pack = _PACKERS[kind](w)
        pack.linear(x, None)  # warm-up (first-call setup)
        start = time.perf_counter()
        for _ in range(reps):
            pack.linear(x, None)
        elapsed = time.perf_counter() - start
        if best is None or elapsed < best[0]:
            best = (elapsed, kind)
    return best[1]


class PackedLinears:
    """Packs every plain fp32/bf16 CPU ``nn.Linear`` of ``model``; engine forwards run through the packs.

    Args:
        model: The model whose linears are packed (in place: their ``forward`` is swapped).
        active: True while an engine forward runs; only then are the packs used.
        kind: "auto" (bf16: oneDNN; fp32: the faster of MKL and oneDNN on this host), "mkl" or "onednn".
    """

    def __init__(self, model: torch.nn.Module, active: Callable[[], bool], kind: str = "auto") -> None:
        if kind not in ("auto", *_PACKERS):
            raise ValueError(f"packing kind must be 'auto', 'mkl' or 'onednn', got {kind!r}")
        self._active = active
        self._modules: list[torch.nn.Linear] = []
        self._packs: dict[int, PackedWeight | OneDnnPackedWeight] = {}
        self.kinds: dict[torch.dtype, str] = {}  # dtype -> packing kind in use
        nbytes = 0
        for module in model.modules():
            w = getattr(module, "weight", None)
            if type(module) is not torch.nn.Linear or w is None or w.device.type != "cpu":
                continue
            packer = self._packer(w, kind)
            if packer is None:
                continue
            self._packs[id(module)] = packer(w)
            nbytes += w.numel() * w.element_size()
            module.forward = self._make_forward(module)
            self._modules.append(module)
        logger.info(
            "pre-packed %d linear layers (%.0f MiB of weights; %s)", len(self._modules), nbytes / 2**20,
            ", ".join(f"{str(d).removeprefix('torch.')}: {k}" for d, k in self.kinds.items()) or "none",
        )

    def _packer(self, weight: torch.Tensor, kind: str):
        dtype = weight.dtype
        if dtype not in self.kinds:
            if dtype == torch.bfloat16:
                chosen = "onednn" if kind in ("auto", "onednn") and available("onednn") else None
            elif dtype == torch.float32:
                chosen = fastest_fp32_kind(*weight.shape) if kind == "auto" else (kind if available(kind) else None)
            else:
                chosen = None
            if chosen is None:
                return None
            self.kinds[dtype] = chosen
        return _PACKERS[self.kinds[dtype]]

    def __len__(self) -> int:
        return len(self._modules)

    def _make_forward(self, module: torch.nn.Linear):
        original = type(module).forward.__get__(module)
        packs = self._packs
        active = self._active
        packer = _PACKERS[self.kinds[module.weight.dtype]]

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = module.weight
            if not active() or x.dtype != weight.dtype or x.device.type != "cpu" or (
                torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            ):
                return original(x)
            pack = packs[id(module)]
            if pack.stale(weight):
                if weight.dtype != pack.source.dtype or weight.device.type != "cpu":
                    return original(x)
                pack = packs[id(module)] = packer(weight)
            return pack.linear(x, module.bias)

        return forward

    def remove(self) -> None:
        for module in self._modules:
            module.__dict__.pop("forward", None)
        self._modules.clear()
        self._packs.clear()
