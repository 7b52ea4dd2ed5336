"""``hf-paged serve --data-parallel-size N``: the flags of the replicated server on Ray Serve and the command.

Checked before anything loads (a bad value ends with one line and exit code 2); docs/scaling.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

from hf_paged.cli.checks import UsageError

_REPLICA_ONLY = ("routing", "replica_num_cpus", "autoscaling_config")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_replica_args(p: argparse.ArgumentParser, positive_int) -> None:
    g = p.add_argument_group("replicas on Ray Serve (pip install hf-paged[ray]; docs/scaling.md)")
    g.add_argument("--data-parallel-size", type=positive_int, default=None,
                   help="engine replicas, each with its own engine and KV cache, behind one OpenAI endpoint "
                   "(starts a local Ray instance unless --ray-address is given)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto, or HEAD_IP:6379 of `ray start --head`) instead of "
                   "starting a local one")
    g.add_argument("--routing", choices=["prefix", "pow2"], default=None,
                   help="which replica gets a request: prefix (longest prompt prefix it was sent, spilling over "
                   "when it is much busier; the default) or pow2 (Ray Serve's power of two choices)")
    g.add_argument("--replica-num-cpus", type=_positive_float, default=None,
                   help="CPUs Ray reserves per engine replica (default 1)")
    g.add_argument("--autoscaling-config", type=_json_object, default=None,
                   help='Ray Serve autoscaling of the engine replicas on queue depth, e.g. \'{"min_replicas": 1, '
                   '"max_replicas": 4, "target_ongoing_requests": 16}\' (--data-parallel-size: the initial count)')


def wants_replicas(args) -> bool:
    """Whether ``hf-paged serve`` runs on Ray Serve (refusing replica-only flags without it)."""
    if args.data_parallel_size is not None or args.ray_address is not None:
        return True
    if any(getattr(args, name) is not None for name in _REPLICA_ONLY):
        raise UsageError("--routing, --replica-num-cpus and --autoscaling-config need --data-parallel-size "
                         "(or --ray-address)")
    return False


def check_replica_args(args) -> None:
    """The Ray-side checks of the replica flags (the packages, the autoscaling config), before any model loads."""
    missing = [m for m in ("ray", "fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"--data-parallel-size needs {', '.join(missing)}: pip install hf-paged[ray]")
    if args.autoscaling_config is not None:
        from hf_paged.serving.replicas import check_autoscaling_config

        try:
            check_autoscaling_config(args.autoscaling_config)
        except ValueError as e:
            raise UsageError(f"--autoscaling-config: {e}") from e


def cmd_serve_replicas(args, served_name: str) -> int:
    """Run the replicated server until interrupted (after :func:`check_replica_args`)."""
    from hf_paged.serving.ray_app import EngineSpec
    from hf_paged.serving.replicas import build_application, run_replicas

    config: dict = {"max_num_seqs": args.max_num_seqs}
    if args.max_model_len:
        config["max_model_len"] = args.max_model_len
    if args.speculative_config:
        config["speculative_config"] = args.speculative_config
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        config["kv_cache_dtype"] = args.kv_cache_dtype
    from hf_paged.cli.engine import tier_options

    # one --prefix-cache-dir for every replica: a replica started later serves a prefix another one computed
    config.update(tier_options(args))
    if getattr(args, "structured_compile_timeout_s", None) is not None:
        config["structured_compile_timeout_s"] = args.structured_compile_timeout_s
    if args.tensor_parallel_size > 1:  # each replica is a tensor-parallel group
        if args.quantization is not None:
            raise UsageError("--quantization cannot be used with --tensor-parallel-size > 1")
        config["tensor_parallel_size"] = args.tensor_parallel_size
    api_key = args.api_key or os.environ.get("HF_PAGED_API_KEY") or None
    spec = EngineSpec(
        model=os.path.abspath(args.model) if args.model else None, dtype=args.dtype, quantization=args.quantization,
        engine_config=config, max_waiting_requests=args.max_waiting_requests, served_model_name=served_name,
        api_key=api_key, request_workers=args.request_workers,
    )
    size = args.data_parallel_size or 1
    app = build_application(spec, size, routing=args.routing or "prefix",
                            autoscaling_config=args.autoscaling_config, replica_num_cpus=args.replica_num_cpus or 1.0)
    where = f"Ray cluster {args.ray_address}" if args.ray_address else "a local Ray instance"
    scaling = f"autoscaling {json.dumps(args.autoscaling_config)}" if args.autoscaling_config else f"{size} replicas"

    def ready() -> None:
        print(f"hf-paged serve: {served_name} on http://{args.host}:{args.port}/v1 ({scaling} on {where}, "
              f"{args.routing or 'prefix'} routing, max_num_seqs={args.max_num_seqs} each"
              f"{', API key required' if api_key else ''})", flush=True)

    run_replicas(app, host=args.host, port=args.port, ray_address=args.ray_address, on_ready=ready)
    return 0
