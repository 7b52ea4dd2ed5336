"""The Triton kernels over an int8 KV pool, by the Triton interpreter (TRITON_INTERPRET=1, set in conftest.py)
on CPU with tiny shapes, fp32/fp16 queries (the interpreter's bf16 dot is wrong), plus the same on CUDA under
the ``gpu`` marker. Unused rows of the pools carry a NaN scale: a kernel reading one returns NaN."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hf_paged import PagedGenerator, SamplingParams  # noqa: E402
from hf_paged.kernels import kv_quant  # noqa: E402
from hf_paged.kernels.triton import attention as ta  # noqa: E402
from hf_paged.kernels.reference import store_kv_reference  # noqa: E402
from tests.helpers import make_model, make_prompts  # noqa: E402
from tests.test_kv_int8 import _reference, int8_case  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape,num_splits", [
    (([5, 17, 1, 33], [1, 1, 1, 1]), None),  # decode kernel, one split
    (([5, 17, 1, 33], [1, 1, 1, 1]), 3),  # split-K decode and its reduce
    (([40, 3, 18], [1, 3, 18]), None),  # varlen kernel: prefill, a chunk over a prefix, a decode
])
def test_triton_attention_over_int8_pool_matches_dequantized_reference(dtype, shape, num_splits):
    case = int8_case(*shape, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype)
    want = _reference(case)
    got = ta.paged_attention_triton(*case.args(), num_splits=num_splits)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_triton_int8_window_and_softcap():
    case = int8_case([30, 9], [1, 4], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    got = ta.paged_attention_triton(*case.args(), 7, 4.0)
    torch.testing.assert_close(got, _reference(case, 7, 4.0), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("key_dtype", [torch.float32, torch.float16])
def test_triton_store_writes_the_reference_bytes(key_dtype):
    g = torch.Generator().manual_seed(3)
    key, value = (torch.randn(7, 3, 16, generator=g).to(key_dtype) for _ in range(2))
    key[4, 1] = 0  # an all-zero row: scale 0
    slots = torch.tensor([3, -1, 17, 0, 12, 15, -1])
    k_cache = torch.full((5, 4, 3, 20), 99, dtype=torch.int8)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ta.store_kv_triton(key, value, k_cache, v_cache, slots)
    store_kv_reference(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_triton_rejects_a_malformed_int8_pool():
    case = int8_case([5], [1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="head_dim \\+ 4"):
        ta.paged_attention_triton(case.query, case.k_cache[..., :18], case.v_cache[..., :18], *case.args()[3:])


def test_engine_on_triton_with_int8_pool_matches_the_torch_backend():
    model = make_model("llama")
    prompts = make_prompts(3, [5, 40, 19], seed=1)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    tokens = {}
    for backend in ("torch", "triton"):
        with PagedGenerator(model, block_size=16, num_blocks=32, max_num_batched_tokens=32, kv_cache_dtype="int8",
                            attention_backend=backend) as engine:
            tokens[backend] = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_int8_pool(dtype):
    case = int8_case([70, 3, 300], [1, 3, 1], num_heads=8, num_kv_heads=2, head_dim=128, block_size=16, dtype=dtype,
                     device="cpu")
    args = [a.to(_device()) if torch.is_tensor(a) else a for a in case.args()]
    got = ta.paged_attention_triton(*args)
    torch.testing.assert_close(got.cpu().float(), _reference(case), atol=2e-2, rtol=2e-2)
    key = torch.randn(4, 2, 128, device="cuda", dtype=dtype)
    k_cache = torch.zeros(4, 16, 2, 132, dtype=torch.int8, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    ta.store_kv_triton(key, key, k_cache, v_cache, torch.tensor([0, 5, 17, 40], device="cuda"))
    back = kv_quant.dequantize_rows(k_cache.view(-1, 2, 132)[[0, 5, 17, 40]])
    scale = key.float().abs().amax(-1, keepdim=True) / 127
    assert ((back - key.float()).abs() <= scale * 0.51).all()
