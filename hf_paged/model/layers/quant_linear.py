"""Weight-only quantized linear layers for CPU (``csrc/quant_gemm.c``, ``csrc/quant_q8.c``): :class:`QuantLinear`.

A :class:`QuantLinear` holds its weight as the raw quantized bytes (a uint8 tensor ``[out_features,
in_features // 32 * block_bytes]``) in one of :data:`FORMATS` (:mod:`hf_paged.kernels.cpu.quant_formats`) and computes
``y = x @ dequant(W)^T + b`` in one of two kernel modes (its ``activations`` attribute):

- ``"float"`` (default, the exact reference): fp32 activations and accumulation, exactly the dequantized weights
  times the activations up to the order of the fp32 sums. Batches of up to 16 rows run straight on the quantized
  bytes; larger ones dequantize tiles of weight rows into a cache-resident buffer that every row meets there;
  batches above :data:`TILED_ROWS` rows dequantize the whole weight once and run ``F.linear`` (MKL).
- ``"int8"``: each row of activations rounded to int8 per block of 32 (:func:`quantize_activations`), integer
  dot products (VNNI where present), for every batch size: faster, and different numbers (exactly the rounded
  activations times the dequantized weights, up to fp32 rounding).
- ``"bf16"``: activations and dequantized weights rounded to bf16 (:func:`round_bf16`), products summed in fp32
  on AMX-BF16 tiles (``csrc/quant_bf16.c``), for every batch size: the fast mode for large batches, on CPUs with
  AMX-BF16 only. A bf16 model's activations go in and come out as bf16 (the same numbers as converting them).

Where a C library cannot be built, fails its probe or (bf16) the CPU lacks AMX-BF16, calls take the float kernel
(int8, bf16 -> float; one warning) or dequantize in torch (one warning).
"""

from __future__ import annotations

import ctypes
import logging
import math

import torch

from hf_paged.kernels.cpu import probes
from hf_paged.kernels.cpu.native import NativeLibrary
from hf_paged.kernels.cpu.quant_formats import (  # noqa: F401 - re-exported
    ACTIVATIONS, BLOCK_BYTES, FORMATS, GROUP, QUANTIZATIONS, check_format, dequantize_torch, quantize,
    quantize_activations, round_bf16,
)
from hf_paged.model.layers import quant_layout

logger = logging.getLogger(__name__)

TILED_ROWS = 256  # float mode: batches up to this many rows run the C kernel; larger ones dequantize and F.linear

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_LINEAR = (_i32, [_ptr, _i64, _ptr, _i32, _ptr, _ptr, _ptr, _i64, _i32, _i32, _i32, _i32])
_FUNCTIONS = {
    "hfq_vector_width": (_i32, []),
    "hfq_block_bytes": (_i32, [_i32]),
    "hfq_linear": _LINEAR,
    "hfq_dequantize": (_i32, [_ptr, _i32, _ptr, _ptr, _i32, _i32, _i32]),
}
_Q8_FUNCTIONS = {
    "hfq8_has_simd": (_i32, []),
    "hfq8_amx": (_i32, []),
    "hfq8_linear": _LINEAR,
    "hfq8_quantize": (_i32, [_ptr, _i64, _i32, _i32, _ptr, _ptr, _ptr, _i32]),
    "hfq8i_available": (_i32, []),
    "hfq8i_bytes": (_i64, [_i32, _i32, _i32]),
    "hfq8i_repack": (_i32, [_ptr, _i32, _i32, _i32, _ptr, _i32]),
    "hfq8i_linear": _LINEAR,
}
_BF16_FUNCTIONS = {"hfqb_available": (_i32, []), "hfqb_linear": _LINEAR, "hfqb_linear_bf16": _LINEAR}
QUANT_GEMM = NativeLibrary("quant_gemm.c", _FUNCTIONS, what="the native quantized linear kernel")
QUANT_Q8 = NativeLibrary("quant_q8.c", _Q8_FUNCTIONS, what="the int8-activation quantized linear kernel")
QUANT_BF16 = NativeLibrary("quant_bf16.c", _BF16_FUNCTIONS, what="the bf16-activation (AMX) quantized linear kernel")
# The same sources without AVX-512 (the AVX2 + FMA baseline; for int8 activations also without AVX-VNNI), for
# tests on AVX-512 hosts.
QUANT_GEMM_AVX2 = NativeLibrary("quant_gemm.c", _FUNCTIONS, ("-mno-avx512f",), what="the AVX2 quantized linear kernel")
QUANT_Q8_AVX2 = NativeLibrary("quant_q8.c", _Q8_FUNCTIONS, ("-mno-avx512f", "-mno-avxvnni"),
                              what="the AVX2 int8-activation quantized linear kernel")
# ... and without AMX (the VNNI vector path for batches above 16 rows too)
QUANT_Q8_NO_AMX = NativeLibrary("quant_q8.c", _Q8_FUNCTIONS, ("-mno-amx-tile", "-mno-amx-int8"),
                                what="the int8-activation quantized linear kernel without AMX")
# ... and the bf16 kernel without AMX (as on a CPU without AMX-BF16: it reports so and refuses), for tests
QUANT_BF16_NO_AMX = NativeLibrary("quant_bf16.c", _BF16_FUNCTIONS, ("-mno-amx-tile", "-mno-amx-bf16"),
                                  what="the bf16-activation quantized linear kernel without AMX")
_warned: set[str] = set()


def _probe_cases(lib: ctypes.CDLL, activations: str):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 64, generator=g)
    b = torch.randn(37, generator=g)
    for fmt in FORMATS:
        layer = QuantLinear.from_weight(w, b, fmt)
        ref = dequantize_torch(layer.qweight, fmt, layer.scales, 64)
        for rows in (1, 5, 17):
            x = torch.randn(rows, 64, generator=g)
            xin, wref = _reference_operands(activations, x, ref)
            want = torch.nn.functional.linear(xin, wref, b)
            got = layer._call(_linear_fn(lib, activations), x)
            probes.check_close(got, want, f"{fmt} quantized linear, {activations} activations ({rows} rows)")
            if activations == "bf16":  # bf16 in and out (a bf16 model's activations)
                got = layer._call(lib.hfqb_linear_bf16, xin.bfloat16(), io=torch.bfloat16)
                probes.check_close(got, want.bfloat16(), f"{fmt} quantized linear, bf16 in and out ({rows} rows)")


def _reference_operands(activations: str, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, w)`` rounded as the kernel mode ``activations`` rounds them (the fp32 weight dequantized already)."""
    if activations == "int8":
        return quantize_activations(x.reshape(-1, x.shape[-1])).view(x.shape).to(x.dtype), w
    if activations == "bf16":
        return round_bf16(x).to(x.dtype), round_bf16(w)
    return x, w


_LINEAR_NAMES = {"float": "hfq_linear", "int8": "hfq8_linear", "bf16": "hfqb_linear"}


def _linear_fn(lib: ctypes.CDLL, activations: str):
    """The linear function of mode ``activations`` in ``lib`` (a build of that mode's source)."""
    return getattr(lib, _LINEAR_NAMES[activations])


def _probe_mode(dtype: torch.dtype, library, activations: str, what: str) -> None:
    if dtype != torch.float32:
        raise NotImplementedError("the quantized linear kernel takes fp32 activations")
    lib = library.load()
    if lib is None:
        raise RuntimeError(f"the {what} is not built: {library.why}")
    if activations == "bf16" and not lib.hfqb_available():
        raise RuntimeError("this CPU (or its OS) has no AMX-BF16 tiles, which the bf16 mode needs")
    _probe_cases(lib, activations)


def _probe(dtype: torch.dtype) -> None:
    _probe_mode(dtype, QUANT_GEMM, "float", "native quantized linear kernel")


def _probe_q8(dtype: torch.dtype) -> None:
    _probe_mode(dtype, QUANT_Q8, "int8", "int8-activation kernel")


def _probe_bf16(dtype: torch.dtype) -> None:
    _probe_mode(dtype, QUANT_BF16, "bf16", "bf16-activation kernel")


probes.register("linear.quant", _probe)
probes.register("linear.quant_q8", _probe_q8)
probes.register("linear.quant_bf16", _probe_bf16)
_PATHS = {"float": ("linear.quant", QUANT_GEMM), "int8": ("linear.quant_q8", QUANT_Q8),
          "bf16": ("linear.quant_bf16", QUANT_BF16)}


def mode_available(activations: str) -> bool:
    """Whether mode ``activations`` runs its own C kernel here (built, probed; bf16: AMX-BF16), without warning."""
    return probes.probe(_PATHS[activations][0], torch.float32).ok


def native_library(activations: str = "float") -> ctypes.CDLL | None:
    """The kernel library of a mode if it builds and passes its probe here, else None (warned once)."""
    path, library = _PATHS[activations]
    known = probes._results.get((path, torch.float32))  # the hot path: one dict read
    if known is not None and known.ok and library._lib is not None:
        return library._lib
    result = probes.probe(path, torch.float32)
    if result.ok:
        return library.load()
    if path not in _warned:
        _warned.add(path)
        then = "float activations" if activations != "float" else "dequantize in torch on every call (slow)"
        logger.warning("quantized linears with %s activations: %s instead: %s", activations, then, result.reason)
    return None


def kernel(activations: str) -> tuple:
    """``(function, mode)``: the C linear of ``activations`` where it passes its probe, else the float one (or
    ``(None, None)``: dequantize in torch)."""
    if activations != "float":
        lib = native_library(activations)
        if lib is not None:
            return _linear_fn(lib, activations), activations
    lib = native_library("float")
    return (None, None) if lib is None else (lib.hfq_linear, "float")


def describe_modes() -> dict[str, str]:
    """Per kernel mode, which kernel its quantized linears run here and, where it is not the mode's own, why (for
    ``hf-paged env``). It reads the probes, as :func:`kernel` does, but warns nothing: it says so itself."""

    def passes(mode: str) -> bool:
        return probes.probe(_PATHS[mode][0], torch.float32).ok

    out = {}
    for mode in ACTIVATIONS:
        got = mode if passes(mode) else "float" if mode != "float" and passes("float") else None
        if got == mode:
            out[mode] = f"C kernel ({_PATHS[mode][1].source.name})"
            continue
        failed = mode if got == "float" else "float"  # the probe that sent it elsewhere
        result = probes._results.get((_PATHS[failed][0], torch.float32))
        instead = "the float kernel" if got == "float" else "torch (dequantized on every call)"
        out[mode] = f"{instead} instead: {result.reason if result is not None else 'not probed'}"
    return out


class QuantLinear(torch.nn.Module):
    """A linear layer whose weight stays quantized: ``y = x @ dequant(qweight)^T + bias``.

    Args:
        in_features: K (a multiple of 32).
        out_features: N.
        fmt: One of :data:`FORMATS`.
        qweight: uint8 ``[N, K // 32 * BLOCK_BYTES[fmt]]``, the blocks of each row in order.
        scales: fp32 ``[N]`` row scales (``"int8"`` only).
        bias: ``[N]`` or None.
        activations: The kernel mode, "float" (exact), "int8" or "bf16" (see the module docstring); an attribute
            that may be changed later.
    """

    def __init__(self, in_features: int, out_features: int, fmt: str, qweight: torch.Tensor,
                 scales: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 activations: str = "float") -> None:
        super().__init__()
        check_format(fmt, in_features)
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        want = (out_features, in_features // GROUP * BLOCK_BYTES[fmt])
        if qweight.dtype != torch.uint8 or tuple(qweight.shape) != want:
            raise ValueError(f"qweight must be uint8 of shape {want} for {fmt}, got {qweight.dtype} {tuple(qweight.shape)}")
        if (fmt == "int8") != (scales is not None) or (scales is not None and tuple(scales.shape) != (out_features,)):
            raise ValueError(f"scales must be fp32 [{out_features}] for int8 and None for the block formats")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.activations = activations
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", None if scales is None else scales.float().contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, quantization: str,
                    activations: str = "float", row_absmax: torch.Tensor | None = None) -> QuantLinear:
        """Quantize a float ``weight [N, K]`` (see :func:`quantize`)."""
        fmt, qweight, scales = quantize(weight, quantization, row_absmax)
        return cls(weight.shape[1], weight.shape[0], fmt, qweight, scales, bias, activations)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, quantization: str, activations: str = "float") -> QuantLinear:
        return cls.from_weight(linear.weight, linear.bias, quantization, activations)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}, "
                f"bias={self.bias is not None}, activations={self.activations}")

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized weight (and scales)."""
        return self.qweight.numel() + (0 if self.scales is None else self.scales.numel() * 4)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` these bytes stand for."""
        lib = native_library()
        if lib is None:
            return dequantize_torch(self.qweight, self.fmt, self.scales, self.in_features)
        out = torch.empty(self.out_features, self.in_features)
        rc = lib.hfq_dequantize(self.qweight.data_ptr(), FORMATS[self.fmt], self._scales_ptr(), out.data_ptr(),
                                self.out_features, self.in_features, torch.get_num_threads())
        assert rc == 0, f"hfq_dequantize failed ({rc})"
        return out

    def kernel(self) -> tuple:
        """``(function, mode, weight)``: the C linear this layer's calls take (see :func:`kernel`; ``(None, None,
        None)``: dequantize in torch) and the weight bytes it reads: in int8 mode the weight's interleaved copy
        where :func:`~hf_paged.model.layers.quant_layout.rows8_chosen` for its format, else ``qweight``."""
        fn, mode = kernel(self.activations)
        if fn is None:
            return None, None, None
        lib = native_library("int8") if mode == "int8" else None
        if lib is not None and quant_layout.rows8_chosen(self.fmt, lib):
            return lib.hfq8i_linear, mode, quant_layout.rows8_copy(self, lib)
        return fn, mode, self.qweight

    _rows8_cache: tuple | None = None  # quant_layout.rows8_copy: (key of qweight, its interleaved copy)

    def _scales_ptr(self) -> int | None:
        return None if self.scales is None else self.scales.data_ptr()

    lora = None  # the LoRA slot (hf_paged.model.layers.linear): callable (x, y) -> y, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` (any float dtype, computed in fp32) -> ``[..., N]`` in ``x``'s dtype, plus the LoRA
        slot's deltas where one is set."""
        y = self._linear(x)
        slot = self.lora
        return y if slot is None else slot(x, y)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input [..., {self.in_features}], got {tuple(x.shape)}")
        fn, mode, weight = self.kernel() if x.device.type == "cpu" else (None, None, None)
        rows = math.prod(x.shape[:-1])
        if fn is None or (mode == "float" and rows > TILED_ROWS) or (torch.is_grad_enabled() and x.requires_grad):
            x, w = _reference_operands(mode or self.activations, x, self.dequantize())
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return torch.nn.functional.linear(x, w.to(x.device, x.dtype), bias)
        if mode == "bf16" and x.dtype == torch.bfloat16:  # a bf16 model: no conversion either way
            return self._call(native_library("bf16").hfqb_linear_bf16, x, io=torch.bfloat16)
        return self._call(fn, x, weight=weight)

    def _call(self, fn, x: torch.Tensor, io: torch.dtype = torch.float32, weight: torch.Tensor | None = None
              ) -> torch.Tensor:
        """``fn`` (``hfq_linear``, ``hfq8_linear``, ``hfqb_linear`` of some build; ``hfqb_linear_bf16`` with
        ``io=torch.bfloat16``; ``hfq8i_linear`` with ``weight`` = the interleaved copy) on ``x [..., K]``, in
        ``io`` in and out."""
        weight = self.qweight if weight is None else weight
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != io or x2.stride(-1) != 1:
            x2 = x2.to(io).contiguous()
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features, dtype=io)
        if rows:
            rc = fn(x2.data_ptr(), x2.stride(0), weight.data_ptr(), FORMATS[self.fmt], self._scales_ptr(),
                    None if self.bias is None else self.bias.data_ptr(), y.data_ptr(), self.out_features, rows,
                    self.out_features, self.in_features, torch.get_num_threads())
            assert rc == 0, f"quantized linear kernel failed ({rc})"
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def _native(self, x: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
        """The float-activation kernel of ``lib`` (a build of ``quant_gemm.c``) on ``x``."""
        return self._call(lib.hfq_linear, x)


class QuantEmbedding(torch.nn.Module):
    """An embedding table kept quantized (a GGUF ``token_embd``): looked-up rows are dequantized on the fly.

    Args:
        num_embeddings: Rows (vocabulary size).
        embedding_dim: Width (a multiple of 32).
        fmt: One of the block formats of :data:`FORMATS` (not "int8", whose scales are per row).
        qweight: uint8 ``[num_embeddings, embedding_dim // 32 * BLOCK_BYTES[fmt]]``.
        padding_idx: As ``nn.Embedding``'s (kept for the model's bookkeeping; the row is what the file holds).
        dtype: dtype of the returned embeddings.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: str, qweight: torch.Tensor,
                 padding_idx: int | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        check_format(fmt, embedding_dim)
        if fmt == "int8":
            raise ValueError("QuantEmbedding takes the block formats q8_0, q4_0, q4_1")
        want = (num_embeddings, embedding_dim // GROUP * BLOCK_BYTES[fmt])
        if qweight.dtype != torch.uint8 or tuple(qweight.shape) != want:
            raise ValueError(f"qweight must be uint8 of shape {want} for {fmt}, got {qweight.dtype} {tuple(qweight.shape)}")
        self.num_embeddings, self.embedding_dim, self.fmt = num_embeddings, embedding_dim, fmt
        self.padding_idx, self.dtype = padding_idx, dtype
        self.register_buffer("qweight", qweight.contiguous())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.fmt}"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [...]`` -> ``[..., embedding_dim]``."""
        rows = self.qweight.index_select(0, input_ids.reshape(-1).to(self.qweight.device))
        lib = native_library() if rows.device.type == "cpu" else None
        if lib is None:
            out = dequantize_torch(rows, self.fmt, None, self.embedding_dim)
        else:
            out = torch.empty(rows.shape[0], self.embedding_dim)
            rc = lib.hfq_dequantize(rows.data_ptr(), FORMATS[self.fmt], None, out.data_ptr(), rows.shape[0],
                                    self.embedding_dim, torch.get_num_threads())
            assert rc == 0, f"hfq_dequantize failed ({rc})"
        return out.view(*input_ids.shape, self.embedding_dim).to(self.dtype)
