"""The multi-LoRA delta over a per-token slot index: ``y[t] += scale[s] * (x[t] @ A[s].T) @ B[s].T`` with
``s = index[t]`` (``-1``: a base row, left alone), dispatched on device.

``backend``:
- "auto": the Triton kernels (:mod:`hf_paged.kernels.triton.lora`) for CUDA tensors, torch otherwise;
- "torch": two dense GEMMs over every slot's ranks at once, each row keeping only its own slot's columns (no
  gather, no scatter, no host sync: its shapes depend on the token count only, like the kernels' grids);
- "triton": the Triton kernels (on CPU only under ``TRITON_INTERPRET=1``).

Both backends keep the per-token rank activations in fp32 and round once when adding into ``y``.
"""

from __future__ import annotations

import os

import torch

from hf_paged.kernels.ops import triton_available

BACKENDS = ("auto", "torch", "triton")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def resolve(backend: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA (where triton imports), else "torch"; checks an explicit "triton" can run."""
    if backend not in BACKENDS:
        raise ValueError(f"LoRA kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ImportError("the Triton LoRA kernels need the triton package: pip install 'hf-paged[triton]'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the Triton LoRA kernels run on CUDA tensors, got device {device}; on CPU only under "
                             "the Triton interpreter (TRITON_INTERPRET=1 set before triton is imported)")
    return backend


def check(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, index: torch.Tensor,
          y: torch.Tensor) -> None:
    """ValueError naming the first argument whose shape, dtype or device does not fit the others."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
        raise ValueError(f"expected A [slots, max_rank, in] and B [slots, out, max_rank], got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    slots, _, in_features = a.shape
    out_features = b.shape[1]
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"expected x of shape [num_tokens, {in_features}], got {tuple(x.shape)}")
    if y.shape != (x.shape[0], out_features):
        raise ValueError(f"expected y of shape [{x.shape[0]}, {out_features}], got {tuple(y.shape)}")
    if index.shape != (x.shape[0],) or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expected index of shape [{x.shape[0]}] int32/int64, got {tuple(index.shape)} {index.dtype}")
    if scales.shape != (slots,) or scales.dtype != torch.float32:
        raise ValueError(f"expected scales of shape [{slots}] float32, got {tuple(scales.shape)} {scales.dtype}")
    for name, t in (("x", x), ("A", a), ("B", b), ("y", y)):
        if t.dtype not in DTYPES:
            raise ValueError(f"expected {name} in {DTYPES}, got {t.dtype}")
    for name, t in (("A", a), ("B", b), ("scales", scales), ("index", index), ("y", y)):
        if t.device != x.device:
            raise ValueError(f"expected {name} on {x.device} (x's device), got {t.device}")


def add_lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, index: torch.Tensor,
                   y: torch.Tensor, backend: str = "auto", checked: bool = False) -> None:
    """Add each row's adapter delta into ``y`` in place.

    Args:
        x: ``[num_tokens, in]`` the linear's input rows.
        a: ``[slots, max_rank, in]`` the stacked A (zero past each adapter's rank).
        b: ``[slots, out, max_rank]`` the stacked B (zero past each adapter's rank).
        scales: ``[slots]`` float32, each slot's scale (``lora_alpha / r`` or rsLoRA's).
        index: ``[num_tokens]`` int32/int64, each row's slot; ``-1``: a base row (nothing added).
        y: ``[num_tokens, out]``, any strides (a column view of a group GEMM's output is fine).
        backend: "auto", "torch" or "triton".
        checked: The caller checked the arguments (the engine's hot path): skip :func:`check`.
    """
    if not checked:
        check(x, a, b, scales, index, y)
    if resolve(backend, x.device) == "triton":
        from hf_paged.kernels.triton.lora import lora_expand_triton, lora_shrink_triton

        s = torch.empty(x.shape[0], a.shape[1], device=x.device, dtype=torch.float32)
        lora_shrink_triton(x, a, index, s)
        lora_expand_triton(s, b, scales, index, y)
        return
    add_lora_delta_torch(x, a, b, scales, index, y)


def add_lora_delta_torch(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                         index: torch.Tensor, y: torch.Tensor) -> None:
    """The torch backend: every slot's shrink at once (``[T, slots * R]``), each row's columns of other slots
    zeroed (a base row keeps none), then one GEMM against every slot's B side by side and the row's scale."""
    slots, rank, in_features = a.shape
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return
    own = index.view(-1, 1) == torch.arange(slots, device=index.device, dtype=index.dtype)  # [T, slots]
    s = torch.mm(x.float(), a.reshape(slots * rank, in_features).float().t()).view(num_tokens, slots, rank)
    s.mul_(own.unsqueeze(2))
    b_side = b.float().permute(1, 0, 2).reshape(b.shape[1], slots * rank)  # [out, slots * R]
    delta = torch.mm(s.view(num_tokens, slots * rank), b_side.t())
    delta.mul_(torch.mv(own.float(), scales).unsqueeze(1))
    y.copy_(y.float().add_(delta))
