"""Runs of recorded C calls made one call (kernels/cpu/call_list.py), and the program's lists of them."""

from __future__ import annotations

import ctypes

import pytest
import torch

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.executor.program_ops import CallLists, c_call
from hf_paged.kernels.cpu import attention, call_list, fused_ops, lora_ops, native_gemm, packed_linear
from hf_paged.model.layers import quant_linear
from tests.helpers import make_model, make_prompts

pytestmark = pytest.mark.skipif(call_list.runner() is None, reason="no C compiler here")


def _norm_call(x, w, out, rows, add=None, total=None):
    n = x.shape[1]
    return fused_ops.LIBRARY.load().hfp_rms_norm, (
        x.data_ptr(), n, None if add is None else add.data_ptr(), n, None if total is None else total.data_ptr(), n,
        w.data_ptr(), out.data_ptr(), n, rows, n, 1e-5, 0, fused_ops.torch_sum_lanes(), 1)


def _run(entries) -> None:
    for fn, args in entries:
        assert not fn(*args)


def test_joined_calls_are_the_direct_calls_reading_the_cells_at_each_run(monkeypatch):
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(5, 40), torch.rand(40) + 0.5, torch.rand(40) + 0.5
    rows = ctypes.c_int(2)
    bufs = {k: torch.zeros(5, 40) for k in ("h", "y", "r", "z", "h2", "y2", "r2", "z2")}

    def calls(h, y, r, z):
        def doubled() -> None:  # a Python op between two runs of C calls
            r.copy_(h * 2)

        return [_norm_call(x, w1, h, rows), _norm_call(h, w2, y, rows), (doubled, ()),
                _norm_call(r, w1, z, rows, add=y, total=h), _norm_call(z, w2, r, rows)]

    direct = [c_call(fn, args) for fn, args in calls(*(bufs[k] for k in ("h2", "y2", "r2", "z2")))]
    joined, where = call_list.join(calls(*(bufs[k] for k in ("h", "y", "r", "z"))), frozenset({4}), convert=c_call)
    assert len(joined) == 4 and where == [0, 0, 1, 2, 3]  # two norms, the Python op, one norm, the one kept apart
    assert joined[0][0].names == ["hfp_rms_norm", "hfp_rms_norm"] and joined[3][0].__name__ == "hfp_rms_norm"
    for n in (2, 5, 1):  # the row count is read at each run, by the joined calls as by the direct ones
        rows.value = n
        for b in bufs.values():
            b.zero_()
        _run(joined)
        _run(direct)
        for k in ("h", "y", "r", "z"):
            assert torch.equal(bufs[k], bufs[k + "2"]), k
            assert bufs[k][:n].any() and not bufs[k][n:].any()
    monkeypatch.setenv("HF_PAGED_CALL_LIST", "0")  # the direct calls only
    assert len(call_list.join(calls(*(bufs[k] for k in ("h", "y", "r", "z"))))[0]) == 5


def test_calls_the_runner_cannot_make_stay_direct():
    x, w, out = torch.randn(2, 8), torch.ones(8), torch.zeros(2, 8)
    rows = ctypes.c_int(2)
    argmax = fused_ops.LIBRARY.load().hfp_argmax_rows  # a signature the runner has no case for
    assert call_list.signature(argmax) not in call_list.runner().signatures
    ok = _norm_call(x, w, out, rows)
    wide_cell = (ok[0], ok[1][:9] + (ctypes.c_int64(2),) + ok[1][10:])  # an int argument read from an 8-byte cell
    float_cell = (ok[0], ok[1][:11] + (ctypes.c_float(1e-5),) + ok[1][12:])  # float cells are not taken
    odd = (ok[0], ok[1][:2] + ("no",) + ok[1][3:])
    entries, where = call_list.join([ok, (argmax, (0,) * 8), wide_cell, float_cell, odd, ok])
    assert where == [0, 1, 2, 3, 4, 5] and all(not hasattr(fn, "names") for fn, _ in entries)


def test_a_failing_kernel_stops_the_run_and_is_named():
    lib = attention.LIBRARY.load()
    k, v = torch.randn(1, 16), torch.randn(1, 16)
    k_cache, v_cache = torch.zeros(4, 16), torch.zeros(4, 16)
    slots = torch.tensor([7])  # past the 4-slot pool
    x, w, out = torch.randn(1, 8), torch.ones(8), torch.zeros(1, 8)
    store = (lib.hfp_store_kv, (k.data_ptr(), v.data_ptr(), 64, 64, k_cache.data_ptr(), v_cache.data_ptr(),
                                slots.data_ptr(), 1, 64, 4))
    rows = ctypes.c_int(1)
    entries, _ = call_list.join([_norm_call(x, w, out, rows), store, _norm_call(x, w, out, rows)])
    ((fn, args),) = entries
    out.zero_()
    rc = fn(*args)
    assert rc == -1 and call_list.failed_call(fn) == "hfp_store_kv" and fn.at.value == 1
    assert out.any() and not k_cache.any()  # the first call ran, the store wrote nothing


def test_every_kernel_of_the_program_has_a_runner_case():
    table = call_list.runner().signatures
    libs = [(native_gemm.NATIVE_GEMM, ("hfp_gemm", "hfp_gemm_bf16")), (quant_linear.QUANT_GEMM, ("hfq_linear",)),
            (quant_linear.QUANT_Q8, ("hfq8_linear",)), (quant_linear.QUANT_BF16, ("hfqb_linear", "hfqb_linear_bf16")),
            (fused_ops.LIBRARY, ("hfp_rms_norm", "hfp_rope", "hfp_silu_mul_bf16", "hfp_silu_mul_f32")),
            (attention.LIBRARY, ("hfp_store_kv", "hfp_store_kv_int8", "hfp_paged_attention")),
            (lora_ops.LIBRARY, ("hfp_lora_bgmv_call",))]
    for lib, names in libs:
        loaded = lib.load()
        if loaded is None:
            continue
        for name in names:
            assert call_list.signature(getattr(loaded, name)) in table, name


def test_call_lists_keep_ops_whole_for_the_row_counts_their_c_call_does_not_serve():
    x, w, out = torch.randn(4, 8), torch.ones(8), torch.zeros(4, 8)
    rows = ctypes.c_int(4)

    class Op:  # a quantized linear's op: its C call serves steps of at most 2 rows
        direct = _norm_call(x, w, out, rows) + (lambda n: n <= 2,)

        def __call__(self):
            return 0

    op = Op()
    lists = CallLists([_norm_call(x, w, out, rows), (op, ()), _norm_call(x, w, out, rows)], head=2)
    joined, head = lists.pick(2)
    assert len(joined) == 2 and head == 1 and joined[0][0].names == ["hfp_rms_norm"] * 2
    calls, head = lists.pick(3)  # the op itself between the other calls
    assert len(calls) == 3 and head == 2 and calls[1][0] is op
    assert lists.pick(2)[0] is joined and set(lists._by_rows) == {2, 3}  # asked once per row count
    assert lists.pick(3)[0] is calls


@pytest.mark.parametrize("dtype,kv,inter", [(torch.float32, "auto", 128), (torch.bfloat16, "auto", 128),
                                            (torch.float32, "int8", 128), (torch.float32, "auto", 136)])
def test_program_logits_are_those_of_its_direct_calls(monkeypatch, dtype, kv, inter):
    """The program's joined calls against the same program's calls made one by one: the same logits, bitwise; and
    a width the fp32 SiLU-mul's C pass does not serve (136): the ops one by one at every step, torch's SiLU."""
    if not fused_ops.silu_mul_available(dtype) or not packed_linear.available("native", dtype):
        pytest.skip(f"the {dtype} SiLU-mul kernel or our {dtype} GEMM does not build or pass its probe here")
    # the C SiLU-mul where it serves, whichever of it and torch's the timing at start would pick on this host now
    # (the choice is a timing: on a busy host torch's ops can win it, and the calls below are what is checked)
    monkeypatch.setitem(fused_ops._SILU_FASTER, dtype, True)
    model = make_model("qwen2", seed=14, dtype=dtype, intermediate_size=inter)
    prompts = make_prompts(3, lengths=[4, 17, 9], seed=6)
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=5)
    results = []
    for joined in ("1", "0"):
        monkeypatch.setenv("HF_PAGED_CALL_LIST", joined)
        with PagedGenerator(model, num_blocks=64, max_num_seqs=3, prepack_weights="native",
                            kv_cache_dtype=kv) as engine:
            outs = engine.generate(prompts, params, use_tqdm=False)
            program = engine.executor.runner.fast
            assert program is not None and program.num_runs > 0
            lists = program._ops
            short = len(lists.joined) < len(lists.kept) / 3  # the C calls joined: a few Python ops between them
            assert short == (joined == "1"), (len(lists.joined), len(lists.kept))
            picked, head = lists.pick(1)  # 136: every SiLU-mul its Python op between the runs of C calls
            assert (picked is lists.joined) == (inter % 32 == 0)
            names = [getattr(fn, "__name__", "") for fn, _ in picked]
            assert names[head] in ("hfp_gemm", "hfp_gemm_bf16") and names.count("silu_mul") == (inter % 32 != 0) * 2
            results.append([(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs])
    assert results[0] == results[1]
