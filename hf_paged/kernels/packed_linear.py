"""Pre-packed fp32 ``nn.Linear`` weights for CPU engine steps (MKL's packed GEMM API).

A plain ``F.linear`` on CPU makes MKL re-pack the whole weight matrix on every call. At the batch sizes of a
decode step (tens of rows) that packing is a large part of the matmul: packing each weight once and calling
``cblas_sgemm_compute`` makes the model's matmuls ~1.1-1.5x faster at any row count, with the same kernel
(results are bitwise equal to ``F.linear`` except for tiny row counts, where ``F.linear`` takes a
matrix-vector path).

:class:`PackedLinears` swaps the ``forward`` of every plain fp32 ``nn.Linear`` of a model for one that uses
the packed weight *only inside an engine forward* (``attention.engine_forward``) without autograd; any other
call (training, a plain forward) runs the original ``forward``. A weight changed in place (optimizer step,
``load_state_dict``) or replaced is re-packed on its next use. :meth:`PackedLinears.remove` restores the
modules. The packed copies cost about as much memory as the fp32 weights (MKL reserves more address space
than it writes; untouched pages are never committed).
"""

from __future__ import annotations

import ctypes
import logging
import os
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


def available() -> bool:
    return _mkl() is not None


class PackedWeight:
    """One weight ``[out_features, in_features]`` packed as MKL's B operand of ``x @ W^T``."""

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


class PackedLinears:
    """Packs every plain fp32 CPU ``nn.Linear`` of ``model`` and routes engine forwards through the packs."""

    def __init__(self, model: torch.nn.Module, active: Callable[[], bool]) -> None:
        self._active = active
        self._modules: list[torch.nn.Linear] = []
        self._packs: dict[int, PackedWeight] = {}
        nbytes = 0
        for module in model.modules():
            w = getattr(module, "weight", None)
            if type(module) is not torch.nn.Linear or w is None or w.dtype != torch.float32 or w.device.type != "cpu":
                continue
            pack = PackedWeight(w)
            self._packs[id(module)] = pack
            nbytes += pack.n * pack.k * 4
            module.forward = self._make_forward(module)
            self._modules.append(module)
        logger.info("pre-packed %d linear layers (%.0f MiB of fp32 weights)", len(self._modules), nbytes / 2**20)

    def __len__(self) -> int:
        return len(self._modules)

    def _make_forward(self, module: torch.nn.Linear):
        original = type(module).forward.__get__(module)
        packs = self._packs
        active = self._active

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not active() or x.dtype != torch.float32 or x.device.type != "cpu" or (
                torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad)
            ):
                return original(x)
            pack = packs[id(module)]
            if pack.stale(module.weight):
                pack = packs[id(module)] = PackedWeight(module.weight)
            y = pack.matmul(x)
            return y if module.bias is None else y.add_(module.bias)

        return forward

    def remove(self) -> None:
        for module in self._modules:
            module.__dict__.pop("forward", None)
        self._modules.clear()
        self._packs.clear()
