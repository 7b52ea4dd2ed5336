"""Tensor-parallel ranks run the kernel choices of rank 0 (hf_paged.model.layers.kernel_choices): rank 1 is a
child process on loopback gloo, this process rank 0, each with its own choices already made; after agreeing,
rank 1 holds rank 0's; so does the packing kind per dtype, broadcast where PackedLinears picks it."""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from hf_paged.kernels.cpu import fused_ops, packed_linear
from hf_paged.model.layers import kernel_choices, quant_layout
from hf_paged.model.layers.linear import DenseLinear
from hf_paged.model.layers.packed import PackedLinears
from hf_paged.model.layers.parallel import ParallelLinear

# each rank's shard: a row-parallel fp32 linear and a bf16 one, packed as the (preset) fastest kinds say: the bf16
# one by upcasting, whose fp32 packing is a choice of its own
SHARD = """
def shard(rank):
    bf16 = DenseLinear.adopt(torch.nn.Linear(8, 4).to(torch.bfloat16))
    model = torch.nn.Sequential(ParallelLinear(DenseLinear.adopt(torch.nn.Linear(4, 4)), "sum", rank, 2), bf16)
    packed = PackedLinears(model, "auto")
    return model, {str(d).removeprefix("torch."): k for d, k in packed.kinds.items()}
"""
exec(SHARD)  # noqa: S102  (the same shard in both processes)

RANK1 = """
import datetime, json, torch, torch.distributed as dist
from hf_paged.kernels.cpu import fused_ops, packed_linear
from hf_paged.model.layers import kernel_choices, quant_layout
from hf_paged.model.layers.linear import DenseLinear
from hf_paged.model.layers.packed import PackedLinears
from hf_paged.model.layers.parallel import ParallelLinear
{shard}
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=1, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
try:
    fused_ops.adopt_silu_choices({{"float32": False, "bfloat16": False}})
    quant_layout.adopt_layout_choices({{"q4_1": False, "q8_0": True}})
    packed_linear.adopt_upcast_inner("mkl")
    packed_linear._fastest.update({{(torch.float32, 4, 4, True): "mkl", (torch.bfloat16, 4, 8, True): "upcast"}})
    model, kinds = shard(1)
    before = kernel_choices.decide(model)
    agreed = kernel_choices.agree(model)
    print(json.dumps({{"kinds": kinds, "before": before, "agreed": agreed, "silu": fused_ops.silu_choices(),
                      "layout": quant_layout.layout_choices(), "upcast": packed_linear.upcast_inner_kind((4, 8))}}))
finally:
    dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_one_takes_rank_zeros_timed_choices(tmp_path, monkeypatch):
    # rank 0's choices, made before (as a forward or an earlier engine in the user's process would)
    monkeypatch.setattr(fused_ops, "_SILU_FASTER", {torch.float32: True, torch.bfloat16: True})
    monkeypatch.setattr(quant_layout, "_chosen", {"q4_1": True, "q8_0": False})
    monkeypatch.setattr(packed_linear, "_upcast_inner", "native")
    monkeypatch.setattr(packed_linear, "_fastest", {(torch.float32, 4, 4, True): "native",
                                                    (torch.bfloat16, 4, 8, True): "upcast"})
    assert kernel_choices.agree(torch.nn.Linear(4, 4)) is None  # not a shard: nothing to agree on

    port = _free_port()
    script = tmp_path / "rank1.py"
    script.write_text(textwrap.dedent(RANK1.format(shard=SHARD, port=port)))
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        try:
            model, kinds = shard(0)
            agreed = kernel_choices.agree(model)
        finally:
            dist.destroy_process_group()
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    rank1 = json.loads(out.strip().splitlines()[-1])
    want = {"silu": {"float32": True, "bfloat16": True}, "layout": {"q4_1": True, "q8_0": False}, "upcast": "native"}
    assert agreed == want
    assert rank1["before"] == {"silu": {"float32": False, "bfloat16": False}, "layout": {"q4_1": False, "q8_0": True},
                               "upcast": "mkl"}
    assert rank1["agreed"] == want
    assert kinds == rank1["kinds"] == {"float32": "native", "bfloat16": "upcast"}  # rank 1 had timed mkl
    assert (rank1["silu"], rank1["layout"], rank1["upcast"]) == (want["silu"], want["layout"], want["upcast"])
    # rank 0 kept its own
    assert fused_ops.silu_choices() == want["silu"] and packed_linear.upcast_inner_kind((4, 8)) == "native"
