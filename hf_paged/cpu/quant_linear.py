"""Weight-only quantized linear layers for CPU (``csrc/quant_gemm.c``): :class:`QuantLinear`.

A :class:`QuantLinear` holds its weight as the raw quantized bytes (a uint8 tensor ``[out_features,
in_features // 32 * block_bytes]``) in one of :data:`FORMATS`, and computes ``y = x @ dequant(W)^T + b`` with
fp32 activations and accumulation: exactly the dequantized weights times the activations, up to the order of
the fp32 sums (the contract every test checks against a dequantize-then-``F.linear`` reference).

- ``"q8_0"``, ``"q4_0"``, ``"q4_1"``: GGUF's block formats in GGUF's byte layout (a GGUF file's tensors are
  used as they are stored: :mod:`hf_paged.gguf`).
- ``"int8"``: int8 per output channel, one fp32 scale per row (``w = q * scale[n]``).
- int4 (:func:`quantize`'s ``"int4"``): groups of 32 with a scale and a min, in the ``"q4_1"`` layout.

Batches of up to :data:`DIRECT_ROWS` rows (decode steps) run the C kernel straight on the quantized bytes;
larger ones (prefill) dequantize the weight to fp32 once per call (C, all threads) and run ``F.linear``.
Where the C library cannot be built or fails its probe, every call dequantizes in torch (one warning).
"""

from __future__ import annotations

import ctypes
import logging
import math

import torch

from hf_paged.cpu import probes
from hf_paged.cpu.native import NativeLibrary

logger = logging.getLogger(__name__)

GROUP = 32  # weights per block, every format
FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "int8": 3}  # the C kernel's format codes
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "int8": 32}
QUANTIZATIONS = {"int8": "int8", "int4": "q4_1"}  # quantize-at-start names -> storage format
DIRECT_ROWS = 16  # batches up to this many rows run on the quantized bytes; larger ones dequantize per call

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_FUNCTIONS = {
    "hfq_vector_width": (_i32, []),
    "hfq_block_bytes": (_i32, [_i32]),
    "hfq_linear": (_i32, [_ptr, _i64, _ptr, _i32, _ptr, _ptr, _ptr, _i64, _i32, _i32, _i32, _i32]),
    "hfq_dequantize": (_i32, [_ptr, _i32, _ptr, _ptr, _i32, _i32, _i32]),
}
QUANT_GEMM = NativeLibrary("quant_gemm.c", _FUNCTIONS, what="the native quantized linear kernel")
# The same source without AVX-512 (the AVX2 + FMA baseline), for tests on AVX-512 hosts.
QUANT_GEMM_AVX2 = NativeLibrary("quant_gemm.c", _FUNCTIONS, ("-mno-avx512f",), what="the AVX2 quantized linear kernel")
_warned = False


def check_format(fmt: str, in_features: int) -> None:
    """ValueError unless ``fmt`` is a format here and ``in_features`` a multiple of its group of 32."""
    if fmt not in FORMATS:
        raise ValueError(f"quantized weight format must be one of {sorted(FORMATS)}, got {fmt!r}")
    if in_features % GROUP:
        raise ValueError(
            f"in_features={in_features} is not a multiple of the quantization group size {GROUP}; the formats "
            f"{sorted(FORMATS)} all quantize rows in groups of {GROUP} weights"
        )


def _half(b: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] fp32
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def dequantize_torch(qweight: torch.Tensor, fmt: str, scales: torch.Tensor | None, in_features: int) -> torch.Tensor:
    """The fp32 weight ``[N, in_features]`` in plain torch (the fallback and the tests' reference)."""
    n = qweight.shape[0]
    blocks = qweight.reshape(n, in_features // GROUP, BLOCK_BYTES[fmt])
    if fmt in ("q8_0", "int8"):
        q = blocks[..., 2:] if fmt == "q8_0" else blocks
        q = q.contiguous().view(torch.int8).float()
        if fmt == "int8":
            return (q * scales.view(n, 1, 1)).reshape(n, in_features)
        return (q * _half(blocks[..., :2]).unsqueeze(-1)).reshape(n, in_features)
    start = 2 if fmt == "q4_0" else 4
    nib = blocks[..., start:]
    q = torch.cat([nib & 15, nib >> 4], dim=-1).float()  # low nibbles are weights 0..15, high ones 16..31
    d = _half(blocks[..., :2]).unsqueeze(-1)
    if fmt == "q4_0":
        return ((q - 8) * d).reshape(n, in_features)
    return (d * q + _half(blocks[..., 2:4]).unsqueeze(-1)).reshape(n, in_features)


def quantize(weight: torch.Tensor, quantization: str) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """Quantize a float weight ``[N, K]``: ``(format, qweight, scales)``.

    ``quantization``: "int8" (per output channel, symmetric, round to nearest), "int4" (groups of 32 with a
    scale and a min, stored as "q4_1"), or a format name "q8_0", "q4_0", "q4_1" (GGUF's own quantizers' math).
    """
    fmt = QUANTIZATIONS.get(quantization, quantization)
    if fmt not in FORMATS:
        raise ValueError(f"quantization must be one of {sorted(set(QUANTIZATIONS) | set(FORMATS))}, got {quantization!r}")
    n, k = weight.shape
    check_format(fmt, k)
    w = weight.detach().float()
    if fmt == "int8":
        scales = w.abs().amax(dim=1) / 127
        inv = torch.where(scales == 0, 0.0, 1 / scales)
        q = torch.round(w * inv[:, None]).clamp(-127, 127).to(torch.int8)
        return fmt, q.view(torch.uint8).contiguous(), scales.contiguous()
    blocks = w.reshape(n, k // GROUP, GROUP)
    if fmt == "q8_0":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = torch.round(blocks * inv).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        body = [d.half().view(torch.uint8), q]
    elif fmt == "q4_0":
        idx = blocks.abs().argmax(dim=-1, keepdim=True)
        d = torch.gather(blocks, -1, idx) / -8
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = torch.trunc(blocks * inv + 8.5).clamp(0, 15).to(torch.uint8)
        body = [d.half().view(torch.uint8), q[..., :16] | (q[..., 16:] << 4)]
    else:
        lo, hi = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)
        # quantize against the fp16-rounded scale and min the kernel will read back
        d, m = ((hi - lo) / 15).half(), lo.half()
        inv = torch.where(d.float() == 0, 0.0, 1 / d.float())
        q = torch.round((blocks - m.float()) * inv).clamp(0, 15).to(torch.uint8)
        body = [d.view(torch.uint8), m.view(torch.uint8), q[..., :16] | (q[..., 16:] << 4)]
    return fmt, torch.cat(body, dim=-1).reshape(n, -1).contiguous(), None


def _probe(dtype: torch.dtype) -> None:
    if dtype != torch.float32:
        raise NotImplementedError("the quantized linear kernel takes fp32 activations")
    lib = QUANT_GEMM.load()
    if lib is None:
        raise RuntimeError(f"the native quantized linear kernel is not built: {QUANT_GEMM.why}")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 64, generator=g)
    b = torch.randn(37, generator=g)
    for fmt in FORMATS:
        layer = QuantLinear.from_weight(w, b, fmt)
        for rows in (1, 5, DIRECT_ROWS + 1):
            x = torch.randn(rows, 64, generator=g)
            want = torch.nn.functional.linear(x, dequantize_torch(layer.qweight, fmt, layer.scales, 64), b)
            probes.check_close(layer._native(x, lib), want, f"{fmt} quantized linear ({rows} rows)")


probes.register("linear.quant", _probe)


def native_library() -> ctypes.CDLL | None:
    """The kernel library if it builds and passes its probe here, else None (warned once)."""
    global _warned
    known = probes._results.get(("linear.quant", torch.float32))  # the hot path: one dict read
    if known is not None and known.ok and QUANT_GEMM._lib is not None:
        return QUANT_GEMM._lib
    result = probes.probe("linear.quant", torch.float32)
    if result.ok:
        return QUANT_GEMM.load()
    if not _warned:
        _warned = True
        logger.warning("quantized linears dequantize in torch on every call (slow): %s", result.reason)
    return None


class QuantLinear(torch.nn.Module):
    """A linear layer whose weight stays quantized: ``y = x @ dequant(qweight)^T + bias``.

    Args:
        in_features: K (a multiple of 32).
        out_features: N.
        fmt: One of :data:`FORMATS`.
        qweight: uint8 ``[N, K // 32 * BLOCK_BYTES[fmt]]``, the blocks of each row in order.
        scales: fp32 ``[N]`` row scales (``"int8"`` only).
        bias: ``[N]`` or None.
    """

    def __init__(self, in_features: int, out_features: int, fmt: str, qweight: torch.Tensor,
                 scales: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        check_format(fmt, in_features)
        want = (out_features, in_features // GROUP * BLOCK_BYTES[fmt])
        if qweight.dtype != torch.uint8 or tuple(qweight.shape) != want:
            raise ValueError(f"qweight must be uint8 of shape {want} for {fmt}, got {qweight.dtype} {tuple(qweight.shape)}")
        if (fmt == "int8") != (scales is not None) or (scales is not None and tuple(scales.shape) != (out_features,)):
            raise ValueError(f"scales must be fp32 [{out_features}] for int8 and None for the block formats")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", None if scales is None else scales.float().contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, quantization: str) -> QuantLinear:
        """Quantize a float ``weight [N, K]`` (see :func:`quantize`)."""
        fmt, qweight, scales = quantize(weight, quantization)
        return cls(weight.shape[1], weight.shape[0], fmt, qweight, scales, bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, quantization: str) -> QuantLinear:
        return cls.from_weight(linear.weight, linear.bias, quantization)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}, bias={self.bias is not None}"

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

    def _scales_ptr(self) -> int | None:
        return None if self.scales is None else self.scales.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` (any float dtype, computed in fp32) -> ``[..., N]`` in ``x``'s dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input [..., {self.in_features}], got {tuple(x.shape)}")
        lib = native_library() if x.device.type == "cpu" else None
        rows = math.prod(x.shape[:-1])
        if lib is None or rows > DIRECT_ROWS or (torch.is_grad_enabled() and x.requires_grad):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return torch.nn.functional.linear(x, self.dequantize().to(x.device, x.dtype), bias)
        return self._native(x, lib)

    def _native(self, x: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or x2.stride(-1) != 1:
            x2 = x2.float().contiguous()
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features)
        if rows:
            rc = lib.hfq_linear(
                x2.data_ptr(), x2.stride(0), self.qweight.data_ptr(), FORMATS[self.fmt], self._scales_ptr(),
                None if self.bias is None else self.bias.data_ptr(), y.data_ptr(), self.out_features, rows,
                self.out_features, self.in_features, torch.get_num_threads(),
            )
            assert rc == 0, f"hfq_linear failed ({rc})"
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


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
