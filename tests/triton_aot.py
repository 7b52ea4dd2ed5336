"""Compile the Triton kernels for NVIDIA targets on a machine without a GPU: ``python -m tests.triton_aot``.

The interpreter runs code the real compiler may reject (or compile into register spills), so this compiles
each launch configuration the host heuristics pick, for sm_80 and sm_90, with the specializations a real
launch gets (unit last-dim strides, 16-divisible pointers and strides). It fails on a compile error, on
register spills in a 16-bit configuration, or on more shared memory than an sm_86/sm_89 GPU has per block.
Run by tests/test_triton_kernels.py in a subprocess, because TRITON_INTERPRET must be unset here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hf_paged.kernels.triton import attention as ta  # noqa: E402
from hf_paged.kernels.triton import lora as tl_lora  # noqa: E402
from hf_paged.kernels.triton.decode import decode_kernel, reduce_splits_kernel  # noqa: E402
from hf_paged.kernels.triton.store import store_kv_kernel  # noqa: E402
from hf_paged.kernels.triton.varlen import varlen_kernel  # noqa: E402

MAX_SHARED = 99 * 1024  # sm_86 / sm_89 per-block limit; sm_80 has 163 KB, sm_90 227 KB
FLOATS = {"scale", "softcap"}
TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _compile(fn, pointers: dict, constexprs: dict, arch: int, num_warps: int = 4, num_stages: int = 2):
    constexprs = dict(constexprs)
    signature = {}
    for name in fn.arg_names:
        if name.startswith("stride_") and name.endswith("_dim"):
            constexprs[name] = 1
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name] != "constexpr" and (name.endswith("_ptr") or name.startswith("stride_"))
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def _spill_bytes(compiled) -> int | None:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return sum(int(m) for m in re.findall(r"STACK:(\d+)", usage))


def _attention_pointers(dtype: torch.dtype, kv_int8: bool = False) -> dict:
    t = TRITON_DTYPE[dtype]
    kv = "i8" if kv_int8 else t
    return dict(
        out_ptr=f"*{t}", part_out_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", query_ptr=f"*{t}",
        k_cache_ptr=f"*{kv}", v_cache_ptr=f"*{kv}", k_scale_ptr="*fp32" if kv_int8 else f"*{t}",
        v_scale_ptr="*fp32" if kv_int8 else f"*{t}", block_tables_ptr="*i32", seq_lens_ptr="*i32",
        cu_seqlens_q_ptr="*i32",
    )


def _attention_constexprs(cfg, head_dim: int, group: int, dtype: torch.dtype, block_size: int, extras: bool,
                          kv_int8: bool = False) -> dict:
    return dict(
        KV_INT8=kv_int8,
        GROUP=group, BLOCK_M=cfg.block_m, BLOCK_SIZE=block_size, TILE_N=cfg.tile_n, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=ta.head_dim_pad(head_dim), USE_SOFTCAP=extras, USE_WINDOW=extras,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


# (kernel, dtype, head_dim, group, max_seqlen_q, block_size, softcap+window, arch[, int8 KV pool])
CASES = [
    ("decode", torch.float16, 128, 4, 1, 16, False, 90, True),
    ("decode", torch.bfloat16, 64, 3, 1, 16, True, 80, True),
    ("varlen", torch.bfloat16, 128, 4, 512, 16, False, 90, True),
    ("varlen", torch.float16, 80, 3, 8, 16, True, 80, True),
    ("varlen", torch.float16, 256, 2, 512, 16, False, 90, True),
    ("decode", torch.bfloat16, 256, 2, 1, 256, True, 90, True),
    ("decode", torch.float16, 80, 3, 1, 16, True, 90),
    ("decode", torch.bfloat16, 128, 4, 1, 16, False, 80),
    ("decode", torch.bfloat16, 256, 2, 1, 256, True, 90),
    ("decode", torch.float32, 256, 7, 1, 16, False, 90),
    ("varlen", torch.float16, 80, 3, 8, 16, True, 90),
    ("varlen", torch.bfloat16, 128, 4, 512, 16, False, 90),
    ("varlen", torch.bfloat16, 128, 4, 512, 32, True, 80),
    ("varlen", torch.float16, 256, 2, 512, 16, False, 90),
    ("varlen", torch.float32, 128, 2, 512, 16, True, 90),
    ("varlen", torch.float32, 256, 1, 512, 16, False, 90),
]


def main() -> int:
    failures = []
    for kernel, dtype, head_dim, group, max_q, block_size, extras, arch, *int8 in CASES:
        kv_int8 = bool(int8 and int8[0])
        label = f"{kernel} {TRITON_DTYPE[dtype]}{' int8 KV' if kv_int8 else ''} head_dim={head_dim} group={group} sm_{arch}"
        if kernel == "decode":
            cfg = ta.decode_config(head_dim, group, dtype)
            constexprs = dict(_attention_constexprs(cfg, head_dim, group, dtype, block_size, extras, kv_int8), SPLIT=True)
            fn = decode_kernel
        else:
            cfg = ta.varlen_config(head_dim, group, max_q, dtype, kv_int8)
            constexprs = _attention_constexprs(cfg, head_dim, group, dtype, block_size, extras, kv_int8)
            constexprs["BLOCK_Q"] = cfg.block_m // group
            fn = varlen_kernel
        try:
            compiled = _compile(fn, _attention_pointers(dtype, kv_int8), constexprs, arch, cfg.num_warps, cfg.num_stages)
        except Exception as e:  # noqa: BLE001 - report every failing configuration, not only the first
            failures.append(f"{label}: {type(e).__name__}: {e}")
            continue
        spills = _spill_bytes(compiled)
        shared = compiled.metadata.shared
        print(f"{label} {cfg}: shared={shared} spill_bytes={spills}")
        if shared > MAX_SHARED:
            failures.append(f"{label}: {shared} bytes of shared memory")
        if spills and dtype != torch.float32:
            failures.append(f"{label}: spills {spills} bytes")

    _compile(reduce_splits_kernel, dict(out_ptr="*bf16", part_out_ptr="*fp32", part_m_ptr="*fp32",
                                        part_l_ptr="*fp32", cu_seqlens_q_ptr="*i32"),
             dict(HEAD_DIM=80, HEAD_DIM_PAD=128, NUM_SPLITS_PAD=32), 90)
    _compile(store_kv_kernel, dict(key_ptr="*fp32", value_ptr="*fp32", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
                                   k_scale_ptr="*bf16", v_scale_ptr="*bf16", slot_mapping_ptr="*i64"),
             dict(BLOCK_SIZE=16, HEAD_DIM=80, HEAD_DIM_PAD=128, BLOCK_H=8, KV_INT8=False), 90)
    _compile(store_kv_kernel, dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr="*i8", v_cache_ptr="*i8",
                                   k_scale_ptr="*fp32", v_scale_ptr="*fp32", slot_mapping_ptr="*i64"),
             dict(BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_H=8, KV_INT8=True), 90)
    print("reduce and store kernels compiled")
    failures += _compile_lora()
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


def _compile_lora() -> list[str]:
    """The multi-LoRA shrink and expand kernels, with the tiles their host wrappers pick for a 4096-wide linear."""
    failures = []
    for dtype, max_rank, arch in ((torch.bfloat16, 16, 90), (torch.float16, 64, 80), (torch.float32, 8, 90)):
        t = TRITON_DTYPE[dtype]
        rank_tile = tl_lora.block_r(max_rank)
        width = min(max(16, tl_lora.TILE_ELEMENTS // rank_tile), 4096)
        for fn, pointers, constexprs in (
            (tl_lora.lora_shrink_kernel, dict(x_ptr=f"*{t}", a_ptr=f"*{t}", index_ptr="*i32", s_ptr="*fp32"),
             dict(BLOCK_R=rank_tile, BLOCK_K=width)),
            (tl_lora.lora_expand_kernel, dict(s_ptr="*fp32", b_ptr=f"*{t}", scale_ptr="*fp32", index_ptr="*i32",
                                              y_ptr=f"*{t}"), dict(BLOCK_R=rank_tile, BLOCK_N=width)),
        ):
            label = f"{fn.__name__} {t} max_rank={max_rank} sm_{arch}"
            try:
                compiled = _compile(fn, pointers, constexprs, arch)
            except Exception as e:  # noqa: BLE001 - report every failing configuration
                failures.append(f"{label}: {type(e).__name__}: {e}")
                continue
            spills = _spill_bytes(compiled)
            print(f"{label}: shared={compiled.metadata.shared} spill_bytes={spills}")
            if compiled.metadata.shared > MAX_SHARED:
                failures.append(f"{label}: {compiled.metadata.shared} bytes of shared memory")
            if spills and dtype != torch.float32:
                failures.append(f"{label}: spills {spills} bytes")
    return failures


if __name__ == "__main__":
    sys.exit(main())
