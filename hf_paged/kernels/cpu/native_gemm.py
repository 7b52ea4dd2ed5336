"""Our own GEMM for packed CPU linears (``csrc/gemm_cpu.c``): the ``"native"`` kind of
:mod:`hf_paged.kernels.cpu.packed_linear`, fp32 everywhere and bf16 on CPUs with AVX-512 BF16.

Layouts, prefetching and measurements: docs/cpu.md. The library is built and loaded by
:mod:`hf_paged.kernels.cpu.native` and probed with the other packings in :mod:`hf_paged.kernels.cpu.packed_linear`.
"""

from __future__ import annotations

import ctypes
import math

import torch

from hf_paged.kernels.cpu.native import NativeLibrary

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
NATIVE_GEMM = NativeLibrary(
    "gemm_cpu.c",
    {
        "hfp_gemm_nr": (_i32, []),
        "hfp_gemm_pack": (None, [_ptr, _i64, _i32, _i32, _ptr]),
        "hfp_gemm": (_i32, [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i32, _i32, _i32, _i32]),
        "hfp_gemm_bf16_ok": (_i32, []),
        "hfp_gemm_bf16_nr": (_i32, []),
        "hfp_gemm_bf16_amx": (_i32, []),
        "hfp_gemm_bf16_pack": (None, [_ptr, _i64, _i32, _i32, _ptr]),
        "hfp_gemm_bf16": (_i32, [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i32, _i32, _i32, _i32]),
    },
    what="the native GEMM kernel",
)


class NativePackedWeight:
    """One fp32 or bf16 weight in the panel layout of ``csrc/gemm_cpu.c`` (our own register-blocked GEMM).

    fp32: each output sums its k terms in order (fused multiply-adds where the CPU has FMA), so a row's result
    is the same whatever other rows share the batch. bf16 (CPUs with AVX-512 BF16): AMX tiles (TDPBF16PS, where
    the CPU has AMX-BF16 and the OS grants the tile state) or else VDPBF16PS sum k pairs into fp32, bias added
    in fp32, one rounding to bf16 at the end, again independent of the other rows.
    """

    kind = "native"

    def __init__(self, weight: torch.Tensor) -> None:
        assert weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
        self._pack([weight])
        self.source = weight
        self.version = weight._version
        self.ptr = weight.data_ptr()  # ``param.data = t`` keeps the object and its version

    @classmethod
    def stacked(cls, weights: list[torch.Tensor]) -> NativePackedWeight | None:
        """The pack of ``torch.cat(weights)`` (the same bytes), each weight packed straight into its panels
        without the concatenated copy; None where a weight's rows would share a panel with the next one's (then
        pack the concatenation). The pack watches no weight (:meth:`stale` is always True): its owner does."""
        first = weights[0]
        if first.dtype not in (torch.float32, torch.bfloat16) or any(
            w.dtype != first.dtype or w.dim() != 2 or w.shape[1] != first.shape[1] for w in weights
        ):
            return None
        lib = NATIVE_GEMM.load()
        assert lib is not None, NATIVE_GEMM.why
        nr = lib.hfp_gemm_nr() if first.dtype == torch.float32 else lib.hfp_gemm_bf16_nr()
        if any(w.shape[0] % nr for w in weights[:-1]) or (first.dtype == torch.bfloat16 and first.shape[1] % 2):
            return None
        pack = cls.__new__(cls)
        pack._pack(weights)
        pack.source = pack.version = pack.ptr = None
        return pack

    def _pack(self, weights: list[torch.Tensor]) -> None:
        # the weights' rows one after the other, each weight from the panel its first row starts
        lib = NATIVE_GEMM.load()
        assert lib is not None, NATIVE_GEMM.why
        self.dtype = weights[0].dtype
        self.out_features, self.in_features = sum(w.shape[0] for w in weights), weights[0].shape[1]
        if self.dtype == torch.float32:
            nr, pack, k = lib.hfp_gemm_nr(), lib.hfp_gemm_pack, self.in_features
        else:
            assert lib.hfp_gemm_bf16_ok(), "the native bf16 GEMM needs AVX-512 BF16"
            nr, pack = lib.hfp_gemm_bf16_nr(), lib.hfp_gemm_bf16_pack
            k = self.k_even = self.in_features + self.in_features % 2  # an odd K gets a zero column
        self.packed = torch.empty(-(-self.out_features // nr) * nr * k, dtype=self.dtype)
        row = 0
        for weight in weights:
            w = weight.detach().contiguous()
            if k != w.shape[1]:
                w = torch.nn.functional.pad(w, (0, 1))
            offset = row * k * self.packed.element_size()  # row is a multiple of nr: a panel's first row
            pack(w.data_ptr(), w.stride(0), w.shape[0], k, self.packed.data_ptr() + offset)
            row += w.shape[0]

    def stale(self, weight: torch.Tensor) -> bool:
        return weight is not self.source or weight._version != self.version or weight.data_ptr() != self.ptr

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.dtype == torch.bfloat16:
            return self._linear_bf16(x, bias)
        x2 = x.reshape(math.prod(x.shape[:-1]), self.in_features)
        if x2.stride(-1) != 1 or x2.dtype != torch.float32:
            x2 = x2.float().contiguous()
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        if bias is not None:
            bias = bias.float().contiguous()
        if self.in_features == 0:  # an empty sum: the kernel would leave y unwritten
            y.zero_()
            if bias is not None:
                y += bias
        elif rows:
            NATIVE_GEMM.load().hfp_gemm(
                x2.data_ptr(), x2.stride(0), self.packed.data_ptr(), None if bias is None else bias.data_ptr(),
                y.data_ptr(), self.out_features, rows, self.out_features, self.in_features, torch.get_num_threads(),
            )
        return y.view(*x.shape[:-1], self.out_features)

    def _linear_bf16(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(math.prod(x.shape[:-1]), self.in_features)
        if x2.stride(-1) != 1 or x2.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16).contiguous()
        if self.k_even != self.in_features:
            x2 = torch.nn.functional.pad(x2, (0, 1))
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.bfloat16)
        if bias is not None:
            bias = bias.float().contiguous()
        if self.in_features == 0:
            y.copy_(torch.zeros(rows, self.out_features) if bias is None else bias.expand(rows, -1))
        elif rows:
            NATIVE_GEMM.load().hfp_gemm_bf16(
                x2.data_ptr(), x2.stride(0), self.packed.data_ptr(), None if bias is None else bias.data_ptr(),
                y.data_ptr(), self.out_features, rows, self.out_features, self.k_even, torch.get_num_threads(),
            )
        return y.view(*x.shape[:-1], self.out_features)
