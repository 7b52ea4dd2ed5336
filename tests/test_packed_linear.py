"""Pre-packed fp32 linear layers: same results as F.linear, used only inside engine forwards."""

import pytest
import torch
import torch.nn.functional as F

from hf_paged.attention import engine_forward, engine_forward_active
from hf_paged.kernels import packed_linear
from hf_paged.kernels.packed_linear import PackedLinears, PackedWeight

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="torch without MKL's packed sgemm")


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_matmul_matches_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g)
    x = torch.randn(rows, 80, generator=g)
    got = PackedWeight(w).matmul(x)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-5, rtol=1e-5)
    if rows >= 64:
        assert torch.equal(got, F.linear(x, w))  # the same MKL kernel, without the per-call packing


def test_packs_route_engine_forwards_only_and_follow_weight_changes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16, bias=False))
    x = torch.randn(70, 32)
    want = model(x).detach()
    packs = PackedLinears(model, engine_forward_active)
    assert len(packs) == 2
    calls = []
    original = PackedWeight.matmul
    PackedWeight.matmul = lambda self, t: calls.append(1) or original(self, t)
    try:
        with torch.no_grad():
            plain = model(x)
            assert not calls  # no engine forward: the original Linear.forward ran
            with engine_forward():
                engine = model(x)
            assert len(calls) == 2
        assert torch.equal(plain, want) and torch.equal(engine, want)
        with torch.no_grad():
            model[0].weight.mul_(2)  # in-place change: re-packed on next use
            doubled = model(x)
            with engine_forward():
                assert torch.equal(model(x), doubled)
        with engine_forward():
            y = model(x)  # autograd wanted: falls back to the original forward
        assert y.requires_grad and len(calls) == 4
    finally:
        PackedWeight.matmul = original
    packs.remove()
    assert "forward" not in model[0].__dict__ and len(packs) == 0
