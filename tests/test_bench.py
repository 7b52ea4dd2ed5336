"""The benchmark harness on a tiny model: every system runs, counts the same tokens and reports."""

import json

import pytest
import torch

from hf_paged import SamplingParams
from hf_paged.bench.baselines import hf_generate_batch, hf_padded_generate
from hf_paged.bench.common import print_report
from hf_paged.bench.workloads import ENGINE, _static_batch_waste, mixed_requests, run_engine
from tests.helpers import make_model, make_prompts


def test_harness_counts_requested_tokens_for_every_system(capsys):
    model = make_model("llama")
    prompts = make_prompts(5, [3, 20, 7, 12, 1], seed=9)
    limits = [4, 9, 2, 6, 5]
    padded, padded_out = hf_padded_generate(model, prompts, limits, 0, None, batch_size=2)
    cb, cb_out = hf_generate_batch(model, prompts, limits, None)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in limits]
    ours, our_out, stats = run_engine(model, prompts, params, dict(num_blocks=64), track_kv=True)
    assert padded.tokens == cb.tokens == ours.tokens == sum(limits)
    assert our_out == padded_out  # greedy, fp32
    assert stats["kv_waste"] >= 1.0
    payload = print_report("mixed", "fp32", [padded, cb, ours], ENGINE, {"note": 1})
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(line)["speedup"] == payload["speedup"]
    assert set(payload["speedup"]) == {padded.system, cb.system}


def test_mixed_requests_follow_the_spec():
    prompts, outs = mixed_requests()
    assert len(prompts) == 64 and all(16 <= len(p) <= 512 for p in prompts) and all(16 <= n <= 256 for n in outs)
    assert mixed_requests() == (prompts, outs)  # seeded
    assert _static_batch_waste([[1] * 4, [1] * 2], [3, 1], 2) == round(2 * 7 / 10, 3)


def test_prefix_workload_requests_and_fork_block_count():
    from hf_paged.bench.workloads import fork_blocks, prefix_requests

    prompts = prefix_requests()
    assert len(prompts) == 64 and all(len(p) == 544 for p in prompts)
    assert all(p[:512] == prompts[0][:512] for p in prompts) and len({tuple(p[512:]) for p in prompts}) == 64
    blocks = fork_blocks(make_model("llama"), make_prompts(1, [512], seed=3)[0], n=8, new_tokens=32)
    # 32 shared prompt blocks + 8 x 2 private vs 8 x 34 (see docs/benchmarks.md)
    assert blocks["n=8"] <= blocks["8 separate"] / 4, blocks


def test_quantized_system_names_choose_weights_and_kernel_mode():
    """``--systems int4-bf16`` etc.: the name's base picks the weights, its suffix the kernel mode; and the command
    line's --quant-activations reaches the engine keywords."""
    import argparse

    from hf_paged.bench.workloads import QUANTIZED, quantized_engine
    from hf_paged.cli.engine import engine_options

    model = object()
    assert quantized_engine("int4", "fp32", model) == (model, {"quantization": "int4"})
    assert quantized_engine("int8-a8", "fp32", model) == (model, {"quantization": "int8", "quant_activations": "int8"})
    assert quantized_engine("int4-bf16", "fp32", model) == (model, {"quantization": "int4", "quant_activations": "bf16"})
    assert {"gguf_q4_1-bf16", "int8-bf16", "int4-a8"} <= set(QUANTIZED) and len(QUANTIZED) == 9
    args = argparse.Namespace(quantization="int4", quant_activations="bf16", kv_cache_dtype="auto",
                              tensor_parallel_size=1)
    assert engine_options(args) == {"quantization": "int4", "quant_activations": "bf16"}


def test_prefix_restart_reports_each_tier_with_its_hits(tmp_path):
    from hf_paged.bench.kv_tiers import tier_ttft
    from tests.helpers import make_model

    report = tier_ttft(make_model(), prompt_len=32, folder=str(tmp_path))
    assert set(report["ratio_to_cold"]) == {"pool", "host", "disk"}
    assert report["host_hits_blocks"] == 2 and report["disk_hits_blocks"] == 2  # 32 tokens = 2 blocks of 16
    assert report["disk_files_skipped"] == 0


def test_model_shapes_have_their_published_sizes():
    """The bigger shapes of ``--model-shape`` count the parameters their models publish (tied embeddings)."""
    from transformers import AutoModelForCausalLM

    from hf_paged.bench.shapes import SHAPES, shape_config

    published = {"smollm2-360m": 361.8e6, "smollm2-1.7b": 1711.4e6, "qwen2.5-0.5b": 494.0e6}
    assert set(SHAPES) == set(published)
    for name, params in published.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(shape_config(name))
        count = sum(p.numel() for p in model.parameters())
        assert abs(count - params) / params < 0.01, (name, count)


def test_model_shape_flag_is_checked_and_matches_the_shapes(capsys):
    from hf_paged.bench.shapes import NAMES
    from hf_paged.cli.commands import build_parser, main

    bench = next(a for a in build_parser()._subparsers._group_actions[0].choices["bench"]._actions
                 if a.dest == "model_shape")
    assert tuple(bench.choices) == NAMES and bench.default == NAMES[0]
    assert main(["bench", "mixed", "--model-shape", "smollm2-360m"]) == 2
    assert "--model-shape applies to the chat and latency workloads" in capsys.readouterr().err
    assert main(["bench", "latency", "--model-shape", "qwen2.5-0.5b", "--systems", "gguf_q4_1"]) == 2
    assert "with --model-shape use int4" in capsys.readouterr().err


def test_bench_spec_on_the_chat_prompts_reports_each_system_and_its_gate(capsys):
    from hf_paged.bench.common import load_chat_messages
    from hf_paged.bench.spec import chat_prompt_ids, spec
    from hf_paged.model.default_model import load_default

    _, tok = load_default()
    ids = chat_prompt_ids(tok)
    assert len(ids) == len(load_chat_messages()) == 64 and len(set(map(tuple, ids))) == 64
    payload = spec(systems={"no_spec", "ngram"}, max_tokens=4, batch1_prompts=1, batches=(1,), prompt_set="chat")
    assert payload["prompt_set"] == "chat" and set(payload["results"]) == {"batch1/no_spec", "batch1/ngram"}
    ngram = payload["results"]["batch1/ngram"]
    assert ngram["same_tokens_as_no_spec"] == "1/1" and isinstance(ngram["gate"], dict)
    assert "chat prompts, at most 4 new tokens" in capsys.readouterr().out


def test_startup_times_the_first_byte_and_the_exit_of_a_process():
    import sys

    from hf_paged.bench.startup import run_process

    script = "import sys, time\ntime.sleep(0.3)\nprint('x', flush=True)\ntime.sleep(0.5)\nsys.stderr.write('e' * 200000)"
    first, end, out = run_process([sys.executable, "-c", script], {})
    assert 0.3 <= first < end and end - first >= 0.45 and out == "x\n"  # much stderr: no pipe to fill up
    first, end, out = run_process([sys.executable, "-c", "pass"], {})
    assert first == end and out == ""
    with pytest.raises(RuntimeError, match="failed \\(3\\).*boom"):
        run_process([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"], {})
