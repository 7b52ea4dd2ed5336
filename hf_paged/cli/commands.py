"""``hf-paged``: generate from the command line, run a batch of chat prompts, serve, benchmark, describe the machine.

Arguments are checked before any model is loaded; bad input ends with one line, ``hf-paged: error: ...``,
and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from hf_paged.cli.engine import build_engine
from hf_paged.cli.checks import (  # noqa: F401 - _chat_messages re-exported
    UsageError, _chat_messages, _non_negative_float, _non_negative_int, _positive_int, check_model_folder, check_port,
    read_conversations,
)
from hf_paged.cli.options import (  # noqa: F401 - SERVER_COMPILE_TIMEOUT_S re-exported
    SERVER_COMPILE_TIMEOUT_S, _add_bench_args, _add_sampling, _add_server_args, _HelpFormatter, _Parser,
)


def _params(args):
    from hf_paged.sampling_params import SamplingParams

    try:
        return SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed,
        )
    except (ValueError, TypeError) as e:
        message = str(e)
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
            if message.startswith(name):  # name the flag, not the field
                message = "--" + name.replace("_", "-") + message[len(name):]
        raise UsageError(message) from e


def _as_prompt(tokenizer, text: str, raw: bool):
    if raw or not getattr(tokenizer, "chat_template", None):
        return text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def cmd_generate(args) -> int:
    params = _params(args)
    check_model_folder(args.model)
    engine, tokenizer = build_engine(args, max_num_seqs=max(8, len(args.prompts)))
    prompts = [_as_prompt(tokenizer, p, args.raw) for p in args.prompts]
    if len(prompts) == 1:
        for delta in engine.stream(prompts[0], params):
            sys.stdout.write(delta.text or "")
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    for text, out in zip(args.prompts, engine.generate(prompts, params, use_tqdm=False)):
        print(f"### {text}\n{out.text}\n")
    return 0


def cmd_batch(args) -> int:
    params = _params(args)
    check_model_folder(args.model)
    conversations = read_conversations(args.file)
    engine, tokenizer = build_engine(args, max_num_seqs=len(conversations))
    prompts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
        for m in conversations
    ]
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=not args.quiet)
    seconds = time.perf_counter() - start
    for conv, out in list(zip(conversations, outs))[: args.show]:
        print(f"### {conv[-1]['content']}\n{out.text.strip()}\n")
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {tokens} tokens in {seconds:.1f} s: {tokens / seconds:.1f} tok/s "
          f"({args.dtype}, {engine.num_steps} steps)")
    return 0


def cmd_env(args) -> int:
    from hf_paged.cli.env_report import collect, format_report

    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def cmd_bench(args) -> int:
    from hf_paged.bench import WORKLOADS
    from hf_paged.bench.systems import parse_systems

    try:
        systems = parse_systems(args.workload, args.systems)
    except ValueError as e:
        raise UsageError(str(e)) from e
    extra = {}
    if args.kv_cache_dtype != "auto":
        if args.workload not in ("chat", "latency"):
            raise UsageError(f"--kv-cache-dtype applies to the chat and latency workloads, not {args.workload}")
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    if args.workload == "serve":
        extra = {"clients": _int_list(args.clients, "--clients"), "num_requests": args.requests,
                 "max_tokens": args.max_tokens}
    elif args.clients is not None or args.requests is not None or args.max_tokens is not None:
        raise UsageError("--clients, --requests and --max-tokens apply to the serve workload only")
    if (args.restart or args.prompt_len is not None) and args.workload != "prefix":
        raise UsageError(f"--restart and --prompt-len apply to the prefix workload, not {args.workload}")
    if args.prompt_len is not None and not args.restart:
        raise UsageError("--prompt-len applies to prefix --restart")
    if args.model_shape != "smollm2-135m":
        if args.workload not in ("chat", "latency"):
            raise UsageError(f"--model-shape applies to the chat and latency workloads, not {args.workload}")
        if any(s.startswith("gguf") for s in systems or ()):
            raise UsageError("the gguf_q4_1 systems run the default model's GGUF file; with --model-shape use int4 "
                             "or int8 (quantized at start)")
        extra["model_shape"] = args.model_shape
    spec_only = (args.eagle_head, args.batch_sizes, args.spec_prompts, args.eagle_k)
    if any(v is not None for v in spec_only) and args.workload != "spec":
        raise UsageError(f"--eagle-head, --eagle-k, --batch-sizes and --spec-prompts apply to the spec workload, "
                         f"not {args.workload}")
    if args.workload == "spec":
        if args.eagle_k is not None:
            if args.eagle_head is None:
                raise UsageError("--eagle-k needs --eagle-head DIR")
            extra["eagle_k"] = args.eagle_k
        if args.spec_prompts is not None:
            extra["prompt_set"] = args.spec_prompts
        if systems is not None and "eagle" in systems and args.eagle_head is None:
            raise UsageError("--systems eagle needs --eagle-head DIR (the head to draft with)")
        if args.eagle_head is not None:
            if not os.path.isfile(os.path.join(args.eagle_head, "config.json")):
                raise UsageError(f"--eagle-head {args.eagle_head!r}: not an EAGLE head folder (no config.json)")
            extra["eagle_head"] = args.eagle_head
        if args.batch_sizes is not None:
            sizes = _int_list(args.batch_sizes, "--batch-sizes")
            if any(b not in (1, 16, 64) for b in sizes):
                raise UsageError(f"--batch-sizes {args.batch_sizes!r}: each must be 1, 16 or 64")
            extra["batches"] = tuple(sizes)
    if args.restart:
        from hf_paged.bench.kv_tiers import prefix_restart

        prefix_restart(dtype=args.dtype, prompt_len=args.prompt_len or 1024)
        return 0
    WORKLOADS[args.workload](dtype=args.dtype, repeat=args.repeat, systems=systems, **extra)
    return 0


def _int_list(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"{flag} must be comma-separated integers >= 1, got {text!r}")
    return values


def _served_name(path: str | None) -> str:
    from hf_paged.model.default_model import DEFAULT_MODEL_NAME

    return os.path.basename(os.path.normpath(path)) if path else DEFAULT_MODEL_NAME


def _require_serve_extra(*modules: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"this command needs {', '.join(missing)}: pip install hf-paged[serve]")


def _engine_loop(args, max_num_seqs: int):
    from hf_paged.serving import AsyncPagedEngine

    config = {"max_num_seqs": max_num_seqs}
    if getattr(args, "max_model_len", None):
        config["max_model_len"] = args.max_model_len
    if getattr(args, "speculative_config", None):
        config["speculative_config"] = args.speculative_config
    if getattr(args, "structured_compile_timeout_s", None) is not None:
        config["structured_compile_timeout_s"] = args.structured_compile_timeout_s
    if getattr(args, "enable_lora", False) or getattr(args, "lora_modules", None):
        config.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    engine, tokenizer = build_engine(args, **config)
    for i, (name, path) in enumerate(getattr(args, "lora_modules", None) or (), start=1):
        from hf_paged.lora.request import LoRARequest

        try:  # checked at start: a bad folder stops the command with the file and the mismatch
            engine.add_lora(LoRARequest(name, i, path))
        except ValueError as e:
            engine.close()
            raise UsageError(f"--lora-modules {name}={path}: {e}") from e
    engine.warm_structured()  # the grammar compile worker starts now, not on the first structured request
    return AsyncPagedEngine(engine, max_waiting_requests=args.max_waiting_requests), tokenizer


def cmd_serve(args) -> int:
    from hf_paged.cli import replicas as cli_replicas

    replicas = cli_replicas.wants_replicas(args)
    if replicas:
        cli_replicas.check_replica_args(args)
    check_model_folder(args.model)
    check_port(args.host, args.port)
    if replicas:
        return cli_replicas.cmd_serve_replicas(args, args.served_model_name or _served_name(args.model))
    _require_serve_extra("fastapi", "uvicorn", "prometheus_client")
    from hf_paged.serving.protocol import ServedModel
    from hf_paged.serving.server import build_app, run_server

    api_key = args.api_key or os.environ.get("HF_PAGED_API_KEY") or None
    name = args.served_model_name or _served_name(args.model)
    loop, tokenizer = _engine_loop(args, args.max_num_seqs)
    aliases = tuple(a for a in (args.model, _served_name(args.model)) if a and a != name)
    lora = args.enable_lora or args.lora_modules
    served = ServedModel(name, tokenizer, loop.max_model_len, args.max_num_seqs, aliases,
                         lora_modules={r.lora_name: r for r in loop.engine.list_loras()} if lora else {})
    app = build_app(loop, served, api_key=api_key, request_workers=args.request_workers)
    print(f"hf-paged serve: {name} on http://{args.host}:{args.port}/v1 "
          f"(max_num_seqs={args.max_num_seqs}, max_model_len={loop.max_model_len}"
          f"{', API key required' if api_key else ''})", flush=True)
    grace = args.exit_grace_seconds if args.exit_on_engine_failure else None
    try:
        return run_server(app, args.host, args.port, log_level="info" if args.verbose else "warning", engine=loop,
                          exit_grace_s=grace)
    finally:
        loop.shutdown()


def cmd_chat(args) -> int:
    check_model_folder(args.model)
    check_port(args.host, args.port)
    _require_serve_extra("gradio")
    params = _params(args)  # checks --temperature, --top-p, --max-tokens before loading
    from hf_paged.ui import ChatDemo

    loop, _ = _engine_loop(args, args.max_num_seqs)
    demo = ChatDemo(loop, title=f"hf_paged chat: {_served_name(args.model)}", system_prompt=args.system_prompt,
                    temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens)
    print(f"hf-paged chat: open http://{args.host}:{args.port}/ (local only, never shared)", flush=True)
    try:
        demo.launch(args.host, args.port, quiet=not args.verbose)
    finally:
        loop.shutdown()
    return 0



def build_parser() -> argparse.ArgumentParser:
    fmt = _HelpFormatter
    parser = _Parser(prog="hf-paged", description=__doc__.splitlines()[0], formatter_class=fmt)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details (KV pool size, fast paths)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate a reply to each prompt (one prompt streams)", formatter_class=fmt)
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_sampling(gen, max_tokens=128, temperature=0.0)
    gen.set_defaults(func=cmd_generate)

    batch = sub.add_parser("batch", help="answer a JSONL file of chat conversations as one continuous batch",
                           formatter_class=fmt)
    batch.add_argument("file", help="JSON lines, each {\"messages\": [{\"role\": ..., \"content\": ...}, ...]}")
    batch.add_argument("--show", type=_non_negative_int, default=3, help="answers to print")
    batch.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_sampling(batch, max_tokens=128, temperature=0.0)
    batch.set_defaults(func=cmd_batch)

    env = sub.add_parser("env", help="versions, CPU features and the kernels picked here (for bug reports)",
                         formatter_class=fmt)
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.set_defaults(func=cmd_env)

    bench = sub.add_parser("bench", help="run a standard workload against its baselines (docs/benchmarks.md)",
                           formatter_class=fmt)
    _add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics "
                           "(pip install hf-paged[serve])", formatter_class=fmt)
    _add_server_args(serve, port=8000, max_num_seqs=128)
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*; $HF_PAGED_API_KEY works too")
    serve.add_argument("--served-model-name", help="the model id clients send (default: the model folder's name)")
    serve.add_argument("--max-model-len", type=_positive_int, help="longest prompt + answer (default: the model's)")
    serve.add_argument("--request-workers", type=_positive_int, default=2,
                       help="threads that parse, chat-template and tokenize request bodies off the event loop")
    serve.add_argument("--exit-on-engine-failure", action=argparse.BooleanOptionalAction, default=True,
                       help="once the engine fails for good (e.g. a tensor-parallel worker died; /health answers "
                       "503), exit with status 1 after --exit-grace-seconds, so that a supervisor restarts the "
                       "server")
    serve.add_argument("--exit-grace-seconds", type=_non_negative_float, default=5.0,
                       help="how long a failed server keeps answering 503s before it exits")
    from hf_paged.cli.replicas import add_replica_args

    add_replica_args(serve, _positive_int)
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser("chat", help="Gradio chat demo with a live engine panel, local only "
                          "(pip install hf-paged[serve])", formatter_class=fmt)
    _add_server_args(chat, port=7860, max_num_seqs=32)
    chat.add_argument("--max-tokens", type=int, default=256, help="initial max tokens per answer")
    chat.add_argument("--temperature", type=float, default=0.7, help="initial temperature (0 is greedy)")
    chat.add_argument("--top-p", type=float, default=0.9, help="initial nucleus sampling mass")
    chat.add_argument("--system-prompt", default="", help="initial system prompt ('' for the model's default)")
    chat.set_defaults(func=cmd_chat, top_k=0, seed=None)
    from hf_paged.cli.train_eagle import add_parser as add_train_eagle

    add_train_eagle(sub, fmt, _positive_int)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except (UsageError, ValueError, TypeError) as e:  # bad input, by this package's convention
        if args is not None and args.verbose and not isinstance(e, UsageError):
            logging.getLogger(__name__).exception("details")
        sys.stderr.write(f"hf-paged: error: {e}\n")
        return 2


def entry() -> int:
    """The ``hf-paged`` console script: tune the process once (hf_paged/launch.py, hf_paged/cli/lifetime.py), then
    run ``main``."""
    from hf_paged import launch
    from hf_paged.cli import lifetime

    argv = sys.argv[1:]
    try:
        launch.tune_process(argv, bind=launch.binds_threads(argv))
        tuned = not launch.switched_off(os.environ)
    except ValueError as e:  # a bad HF_PAGED_TUNE / HF_PAGED_ALLOCATOR value
        sys.stderr.write(f"hf-paged: error: {e}\n")
        return 2
    if tuned:
        lifetime.enable(long_lived=not launch.ends_after_start_up(argv))
    applied = os.environ.get("HF_PAGED_TUNED_WITH")
    if applied and ("-v" in argv or "--verbose" in argv):
        sys.stderr.write(f"hf-paged: process tuned: {applied} (HF_PAGED_TUNE=0 turns this off)\n")
    try:
        status = main(argv)
    except BaseException:
        lifetime.usual_exit()
        raise
    return lifetime.quick_exit(status)


if __name__ == "__main__":
    sys.exit(entry())
