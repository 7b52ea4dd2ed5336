"""The multi-LoRA delta kernels (:mod:`hf_paged.kernels.lora`): the Triton shrink/expand (by the interpreter,
TRITON_INTERPRET=1 set in conftest.py) and the torch backend against a float64 per-token loop, with mixed slots,
base rows (-1), ranks below the padded rank, and a strided output (a column view of a wider buffer)."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels.lora import add_lora_delta

pytest.importorskip("triton")


def reference(x, a, b, scales, index, ranks):
    """float64: each adapter row's ``scale * (x A_r^T) B_r^T`` over its own rank only; zeros for base rows."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for t, slot in enumerate(index.tolist()):
        if slot >= 0:
            r = ranks[slot]
            a_r, b_r = a[slot, :r].double(), b[slot, :, :r].double()
            out[t] = scales[slot].double() * (x[t].double() @ a_r.t()) @ b_r.t()
    return out


def stacked(slots, max_rank, in_f, out_f, ranks, dtype, seed=0):
    """A, B stacked as the slots keep them: random within each slot's rank, zero past it."""
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(slots, max_rank, in_f, dtype=dtype)
    b = torch.zeros(slots, out_f, max_rank, dtype=dtype)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, in_f, generator=g).to(dtype) / in_f**0.5
        b[s, :, :r] = torch.randn(out_f, r, generator=g).to(dtype)
    return a, b


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_delta_matches_reference(backend, dtype):
    slots, max_rank, in_f, out_f = 3, 8, 40, 36  # not powers of two: the masks matter
    ranks = [8, 3, 5]
    a, b = stacked(slots, max_rank, in_f, out_f, ranks, dtype)
    scales = torch.tensor([0.5, 2.0, -1.25])
    index = torch.tensor([1, -1, 0, 2, 2, -1, 1], dtype=torch.int32)  # mixed, with base rows
    g = torch.Generator().manual_seed(1)
    x = torch.randn(index.numel(), in_f, generator=g).to(dtype)
    wide = torch.randn(index.numel(), out_f + 10, generator=g).to(dtype)  # y: a column view of a group's output
    before = wide.clone()
    y = wide[:, 4 : 4 + out_f]
    add_lora_delta(x, a, b, scales, index, y, backend=backend)
    want = before[:, 4 : 4 + out_f].double() + reference(x, a, b, scales, index, ranks)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * 4)
    # the columns around the view, and base rows, are untouched
    assert torch.equal(wide[:, :4], before[:, :4]) and torch.equal(wide[:, 4 + out_f :], before[:, 4 + out_f :])
    base = index < 0
    assert torch.equal(wide[base], before[base])


def test_triton_strided_input_and_int64_index():
    """x a strided view (every other column of a buffer), an int64 index, bigger tiles than one loop step."""
    slots, max_rank, in_f, out_f = 2, 16, 70, 20
    ranks = [16, 1]
    a, b = stacked(slots, max_rank, in_f, out_f, ranks, torch.float32, seed=3)
    scales = torch.tensor([1.5, 3.0])
    index = torch.tensor([0, 1, -1, 1], dtype=torch.int64)
    buf = torch.randn(index.numel(), 2 * in_f, generator=torch.Generator().manual_seed(4))
    x = buf[:, ::2]
    y = torch.zeros(index.numel(), out_f)
    add_lora_delta(x, a, b, scales, index, y, backend="triton")
    torch.testing.assert_close(y.double(), reference(x, a, b, scales, index, ranks), rtol=1e-5, atol=1e-5)


def test_all_base_rows_add_nothing():
    a, b = stacked(2, 4, 8, 8, [4, 4], torch.float32)
    y = torch.randn(3, 8)
    before = y.clone()
    for backend in ("triton", "torch"):
        add_lora_delta(torch.randn(3, 8), a, b, torch.ones(2), torch.full((3,), -1, dtype=torch.int32), y,
                       backend=backend)
    assert torch.equal(y, before)


@pytest.mark.parametrize("bad, match", [
    (dict(index=torch.zeros(3)), "index"),
    (dict(y=torch.zeros(3, 5)), "y of shape"),
    (dict(scales=torch.ones(2, dtype=torch.float64)), "scales"),
    (dict(x=torch.zeros(3, 9)), "x of shape"),
])
def test_bad_arguments_are_named(bad, match):
    a, b = stacked(2, 4, 8, 6, [4, 2], torch.float32)
    args = dict(x=torch.zeros(3, 8), a=a, b=b, scales=torch.ones(2), index=torch.zeros(3, dtype=torch.int32),
                y=torch.zeros(3, 6))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        add_lora_delta(**args, backend="torch")
    with pytest.raises(ValueError, match="backend"):
        add_lora_delta(torch.zeros(3, 8), a, b, torch.ones(2), torch.zeros(3, dtype=torch.int32), torch.zeros(3, 6),
                       backend="cuda")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_slot_with_a_per_token_plan(backend):
    """``LoRASlot`` with a ``"tokens"`` plan (the CUDA layout) adds each row's delta through the kernels: slot 1
    holds an adapter that leaves this linear alone (zeros, scale 0), slot 2 a rank below the padded rank."""
    from hf_paged.lora.loading import LoRALayerWeights
    from hf_paged.lora.slots import LoRASlot, plan_step

    class Source:
        plan = None

    torch.manual_seed(0)
    source = Source()
    slot = LoRASlot(source, 12, 10, max_loras=3, max_rank=4, device=torch.device("cpu"), dtype=torch.float32)
    weights = {0: LoRALayerWeights(torch.randn(4, 12), torch.randn(10, 4), 0.5),
               2: LoRALayerWeights(torch.randn(2, 12), torch.randn(10, 2), 3.0)}
    for index, w in weights.items():
        slot.set(index, w)
    slot.set(1, None)
    assert slot.scale_t.tolist() == [0.5, 0.0, 3.0]
    token_slots = [2, -1, 0, 1, 0, 2]
    x, y = torch.randn(1, len(token_slots), 12), torch.randn(1, len(token_slots), 10)
    expected = y.clone().double()
    for row, index in enumerate(token_slots):
        if index in weights:
            w = weights[index]
            expected[0, row] += (x[0, row].double() @ w.a.double().t() @ w.b.double().t()) * w.scale
    source.plan = plan_step(token_slots, torch.device("cpu"), per_token=True, backend=backend)
    assert source.plan.layout == "tokens"
    torch.testing.assert_close(slot(x, y.clone()).double(), expected, rtol=1e-5, atol=1e-5)
