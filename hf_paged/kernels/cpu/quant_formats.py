"""The quantized weight formats and their torch math: quantizing a float weight, dequantizing one (the fallback and
the tests' reference), and the int8 activation rounding of the kernels' ``activations="int8"`` mode.

Every format quantizes rows in groups (blocks) of :data:`GROUP` weights along the input dimension:
``"q8_0"``, ``"q4_0"``, ``"q4_1"`` are GGUF's block formats in GGUF's byte layout, ``"int8"`` is int8 per output
channel with one fp32 scale per row. See docs/quantization.md.
"""

from __future__ import annotations

import torch

GROUP = 32  # weights per block, every format
FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "int8": 3}  # the C kernel's format codes
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "int8": 32}
QUANTIZATIONS = {"int8": "int8", "int4": "q4_1"}  # quantize-at-start names -> storage format

# kernel modes: exact float activations; activations rounded to int8 per block; activations and dequantized weights
# rounded to bf16 (AMX-BF16 tiles)
ACTIVATIONS = ("float", "int8", "bf16")


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


def quantize(weight: torch.Tensor, quantization: str, row_absmax: torch.Tensor | None = None,
             ) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """Quantize a float weight ``[N, K]``: ``(format, qweight, scales)``.

    ``quantization``: "int8" (per output channel, symmetric, round to nearest), "int4" (groups of 32 with a
    scale and a min, stored as "q4_1"), or a format name "q8_0", "q4_0", "q4_1" (GGUF's own quantizers' math).
    ``row_absmax`` (int8 only): each row's largest magnitude to scale by, where ``weight`` is a slice of the
    rows' columns (a tensor-parallel shard) and the scale must be the whole row's.
    """
    fmt = QUANTIZATIONS.get(quantization, quantization)
    if fmt not in FORMATS:
        raise ValueError(f"quantization must be one of {sorted(set(QUANTIZATIONS) | set(FORMATS))}, got {quantization!r}")
    n, k = weight.shape
    check_format(fmt, k)
    w = weight.detach().float()
    if fmt == "int8":
        scales = (w.abs().amax(dim=1) if row_absmax is None else row_absmax.float()) / 127
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


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16 (nearest, ties to even) and back to fp32: what the ``activations="bf16"`` kernel does to
    each activation and each dequantized weight before the fp32 dot products."""
    return x.float().bfloat16().float()


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` fp32 as the ``activations="int8"`` kernels see it: per row and block of 32, ``d = max|x| / 127``
    and ``q = round(x / d)`` (ties to even), returned dequantized (``q * d``, fp32). The same operations as the
    C code (``csrc/quant_q8.c``), so the same q and d, bitwise."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // GROUP, GROUP)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, 1 / d)
    return (torch.round(blocks * inv) * d).reshape(m, k)
