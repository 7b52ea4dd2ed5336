"""The CPU LoRA delta kernel (``csrc/lora_cpu.c``): against a float64 torch reference, through the slots' three
layouts, and in the engine (eager forward and the native decode program), where it must be the path taken."""

from __future__ import annotations

import pytest
import torch

from hf_paged.executor import program_ops
from hf_paged.kernels.cpu import lora_ops
from hf_paged.lora import slots as lora_slots
from hf_paged.lora.loading import LoRALayerWeights
from hf_paged.lora.slots import LoRASlot, plan_step

if not lora_ops.available(torch.float32):
    pytest.skip(f"the LoRA kernel is not built here: {lora_ops.unavailable_reason(torch.float32)}",
                allow_module_level=True)


def stacked(L: int, R: int, n_in: int, n_out: int, ranks: list[int], dtype: torch.dtype, seed: int):
    """Random A [L, R, in] and Bt [L, R, out], zero past each slot's rank, with the scales and ranks tensors."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(L, R, n_in, generator=g)
    b = torch.randn(L, R, n_out, generator=g)
    for s, r in enumerate(ranks):
        a[s, r:], b[s, r:] = 0, 0
    scales = torch.rand(L, generator=g) * 2 + 0.1
    return a.to(dtype), b.to(dtype), scales, torch.tensor(ranks, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,n_in,n_out,threads", [
    (1, 37, 45, 1), (1, 37, 45, 2),
    (1, 4001, 5003, 2),  # enough work for the threads: the output columns split between them
    (64, 203, 301, 1), (64, 203, 301, 2),  # tokens split between the threads
])
def test_kernel_matches_float64_reference(dtype, T, n_in, n_out, threads):
    g = torch.Generator().manual_seed(T + n_in)
    for first_rank in (1, 5, 9, 13):  # ranks 1..16 over the four slots and calls
        ranks = [first_rank, first_rank + 1, first_rank + 2, first_rank + 3]
        a, b, scales, ranks_t = stacked(4, 16, n_in, n_out, ranks, dtype, seed=first_rank)
        x = torch.randn(T, n_in + 3, generator=g).to(dtype)[:, 1: 1 + n_in]  # strided rows
        wide = torch.randn(T, n_out + 11, generator=g).to(dtype)
        token_slot = torch.randint(-1, 4, (T,), generator=g, dtype=torch.int32)
        if T == 1:
            token_slot[0] = first_rank % 4
        else:
            token_slot[:4] = torch.tensor([-1, 0, 3, 0])  # base rows among them
        want = lora_ops.reference(wide[:, 5: 5 + n_out], x, a, b, token_slot, scales, ranks_t)
        got = wide.clone()
        lora_ops.bgmv_(got[:, 5: 5 + n_out], x, a, b, token_slot, scales, ranks_t, num_threads=threads)
        assert torch.equal(got[:, :5], wide[:, :5]) and torch.equal(got[:, 5 + n_out:], wide[:, 5 + n_out:])
        base = token_slot < 0
        assert torch.equal(got[base], wide[base])
        err = (got[:, 5: 5 + n_out].double() - want).abs().max().item()
        # fp32: the sums' order only; bf16: the reference rounds where PEFT does, so at most one ulp of a
        # rounding the two sums' orders put on different sides
        tol = 1e-4 * want.abs().max().item() if dtype == torch.float32 else 2 ** -7 * want.abs().max().item()
        assert err <= tol, (first_rank, err, tol)


def test_kernel_rejects_bad_arguments():
    a, b, scales, ranks = stacked(2, 8, 16, 24, [4, 8], torch.float32, seed=0)
    x, y, token_slot = torch.randn(3, 16), torch.zeros(3, 24), torch.tensor([0, -1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="shapes do not fit"):
        lora_ops.bgmv_(torch.zeros(3, 23), x, a, b, token_slot, scales, ranks)
    with pytest.raises(ValueError, match="token_slot: expected torch.int32"):
        lora_ops.bgmv_(y, x, a, b, token_slot.long(), scales, ranks)
    with pytest.raises(ValueError, match="ranks"):
        lora_ops.bgmv_(y, x, a, b, token_slot, scales, torch.tensor([4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="float16"):
        lora_ops.bgmv_(y.half(), x.half(), a.half(), b.half(), token_slot, scales, ranks)
    with pytest.raises(ValueError, match="contiguous"):
        lora_ops.bgmv_(y, x, a, b.transpose(1, 2).contiguous().transpose(1, 2), token_slot, scales, ranks)


class _Source:
    plan = None


@pytest.mark.parametrize("token_slots,layout", [
    ([0] * 40 + [-1] * 3 + [2] * 40, "runs"),
    ([0, 2, -1, 0, 2, 1, 0, -1, 2, 0], "padded"),
    ([0] * 9 + [2, -1, 1] + [0] * 9, "segments"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_kernel_equals_torch_layouts(monkeypatch, token_slots, layout, dtype):
    """A slot's deltas through the kernel equal its torch layouts' (the path before the kernel, and CUDA's)."""
    source = _Source()
    slot = LoRASlot(source, 19, 27, max_loras=3, max_rank=8, device=torch.device("cpu"), dtype=dtype)
    g = torch.Generator().manual_seed(7)
    for s, r in ((0, 3), (1, 0), (2, 8)):  # slot 1's adapter leaves this linear alone
        slot.set(s, None if r == 0 else LoRALayerWeights(torch.randn(r, 19, generator=g),
                                                         torch.randn(27, r, generator=g), 0.5 + s))
    x = torch.randn(len(token_slots), 19, generator=g).to(dtype)
    y = torch.randn(len(token_slots), 27, generator=g).to(dtype)
    with torch.inference_mode():
        outs = []
        for kernel in (True, False):
            monkeypatch.setattr(lora_slots, "USE_KERNEL", kernel)
            source.plan = plan_step(token_slots, torch.device("cpu"))
            assert source.plan.layout == layout and source.plan.kernel(dtype) is kernel
            outs.append(slot(x, y.clone()))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(outs[0], outs[1], **tol)
    assert not torch.equal(outs[0], y)


@pytest.fixture()
def torch_path_raises(monkeypatch):
    """The slots' torch layouts and the program's Python delta op raise: only the kernel may add deltas."""
    def fail(*args, **kwargs):
        raise AssertionError("the torch LoRA path ran where the CPU kernel should have")
    monkeypatch.setattr(LoRASlot, "_torch_delta", fail)
    monkeypatch.setattr(program_ops.Delta, "__call__", fail)
    calls = {"n": 0}
    real = lora_ops.call

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(lora_ops, "call", counting)
    return calls


@pytest.mark.parametrize("runner", ["eager", "native"])
def test_engine_uses_the_kernel(tmp_path, torch_path_raises, runner):
    """A mixed batch on the CPU adds its deltas with the kernel only (eager forward: through the slots; native
    program: its recorded C calls), and its greedy rows still equal PEFT's."""
    peft = pytest.importorskip("peft")
    from hf_paged import LoRARequest, PagedGenerator, SamplingParams
    from tests.helpers import make_model, make_prompts, stock_greedy
    from tests.test_lora import ADAPTERS, make_adapter

    base = make_model("llama")
    peft_model = make_adapter(base, tmp_path, seed=5, **ADAPTERS["b"])
    assert isinstance(peft_model, peft.PeftModel)
    req = LoRARequest("b", 1, str(tmp_path))
    names = ["b", None, "b", "b"]
    prompts = make_prompts(len(names), seed=41)
    refs = [stock_greedy(peft_model if n else base, p, 8) for p, n in zip(prompts, names)]
    settings = dict(enable_lora=True, max_loras=2, max_lora_rank=8, num_blocks=64)
    try:
        engine = (PagedGenerator(base, enforce_eager=True, **settings) if runner == "eager" else
                  PagedGenerator(base, decode_runner="native", prepack_weights="native", **settings))
    except ValueError as e:  # the native program needs kernels this CPU may lack
        pytest.skip(str(e))
    with engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False,
                               lora_request=[req if n else None for n in names])
        if runner == "native":  # every step on the program (short prompts), its deltas recorded C calls
            program = engine.executor.runner.fast
            assert program.num_lora_runs >= 8, program.why_not
            assert any(getattr(fn, "__name__", "") == "hfp_lora_bgmv_call" for fn, _ in program._lora_ops.kept)
        else:
            assert torch_path_raises["n"] > 0  # the slots called the kernel's wrapper
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_portable_build_matches_reference():
    """The kernel's plain C loop (built without AVX2/FMA, as on CPUs without them) against the reference."""
    from hf_paged.kernels.cpu.native import NativeLibrary

    portable = NativeLibrary("lora_cpu.c", {"hfp_lora_bgmv": lora_ops.LIBRARY.functions["hfp_lora_bgmv"]},
                             extra_flags=("-ffp-contract=off", "-mno-avx2", "-mno-fma"), what="portable LoRA kernel")
    lib = portable.load()
    if lib is None:
        pytest.skip(portable.why)
    for dtype in (torch.float32, torch.bfloat16):
        a, b, scales, ranks = stacked(3, 12, 29, 35, [3, 12, 7], dtype, seed=2)
        x = torch.randn(5, 29).to(dtype)
        y = torch.randn(5, 35).to(dtype)
        token_slot = torch.tensor([2, -1, 0, 1, 2], dtype=torch.int32)
        want = lora_ops.reference(y, x, a, b, token_slot, scales, ranks)
        rc = lib.hfp_lora_bgmv(x.data_ptr(), x.stride(0), a.data_ptr(), b.data_ptr(), token_slot.data_ptr(),
                               scales.data_ptr(), ranks.data_ptr(), y.data_ptr(), y.stride(0), 5, 3, 29, 35, 12,
                               lora_ops.DTYPES[dtype], 1)
        assert rc == 0
        tol = 1e-4 if dtype == torch.float32 else 2 ** -7
        assert (y.double() - want).abs().max().item() <= tol * want.abs().max().item()
