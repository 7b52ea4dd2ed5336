"""Build and run the replicated server (``hf-paged serve --data-parallel-size N``) on Ray Serve.

:func:`build_application` returns a Ray Serve application (engine replicas + ingress) for ``serve.run``;
:func:`run_replicas` is what the CLI does: join or start Ray, start Serve's HTTP proxy, run the application until
interrupted, and tear down what it started. Needs ``pip install hf-paged[ray]``; docs/scaling.md.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from hf_paged.serving.ray_app import (
    ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, ROUTING_POLICIES, EngineReplica, EngineSpec, Ingress, require_ray,
)

logger = logging.getLogger(__name__)

APP_NAME = "hf_paged"
DEFAULT_HEALTH_CHECK_PERIOD_S = 10.0
# no access log line per call: metrics reports every second and every forwarded request would be logged twice
_QUIET = {"enable_access_log": False}


def check_autoscaling_config(config: object) -> dict:
    """``config`` checked as Ray Serve's ``AutoscalingConfig`` (ValueError naming the bad field)."""
    require_ray()
    from ray.serve.config import AutoscalingConfig

    if not isinstance(config, dict):
        raise ValueError(f"the autoscaling config must be a JSON object, got {config!r}")
    unknown = sorted(set(config) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise ValueError(f"unknown autoscaling config keys {unknown}; Ray Serve's are "
                         f"{sorted(AutoscalingConfig.model_fields)}")
    try:
        AutoscalingConfig(**config)
    except Exception as e:  # pydantic's ValidationError, or a TypeError from an unknown key
        raise ValueError(f"bad autoscaling config {json_text(config)}: {' '.join(str(e).split())}") from e
    return dict(config)


def json_text(value: object) -> str:
    import json

    return json.dumps(value, default=str)


def build_application(
    spec: EngineSpec, num_replicas: int = 2, *, routing: str = "prefix", autoscaling_config: dict | None = None,
    replica_num_cpus: float = 1.0, max_ongoing_requests: int | None = None,
    health_check_period_s: float = DEFAULT_HEALTH_CHECK_PERIOD_S, report_period: float = 1.0,
    imbalance_factor: float = 2.0, imbalance_slack: int = 4, runtime_env: dict | None = None,
):
    """The Ray Serve application: ``num_replicas`` engine replicas behind one ingress.

    Args:
        spec: How each replica loads its model and builds its engine and app.
        num_replicas: Engine replicas (>= 1). With ``autoscaling_config`` it is the initial count, unless the
            config sets ``initial_replicas``.
        routing: ``"prefix"`` (longest known prompt prefix, load-aware spill-over) or ``"pow2"`` (Ray Serve's
            default power-of-two choices).
        autoscaling_config: Ray Serve's autoscaling config of the engine deployment (``min_replicas``,
            ``max_replicas``, ``target_ongoing_requests``, ...): replicas follow the requests queued or running
            per replica.
        replica_num_cpus: CPUs Ray reserves for each engine replica (a GPU engine would ask for ``num_gpus``).
        max_ongoing_requests: Requests one replica accepts at once, running or queued in its engine (default:
            ``max_num_seqs`` + ``max_waiting_requests``, so the engine's own queue limit answers 503s).
        health_check_period_s: How often Ray calls each replica's ``check_health``.
        report_period: Seconds between a replica's metrics reports to the ingress.
        imbalance_factor, imbalance_slack: Prefix routing spills to the least busy replica when the preferred one
            has more than ``max(factor * least, least + slack)`` requests in flight.
        runtime_env: Ray runtime environment of the replicas (e.g. ``{"env_vars": {...}}``).
    """
    _, serve = require_ray()
    from ray.serve.config import RequestRouterConfig

    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas (--data-parallel-size) must be an int >= 1, got {num_replicas!r}")
    if routing not in ROUTING_POLICIES:
        raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {routing!r}")
    if not replica_num_cpus > 0:
        raise ValueError(f"replica_num_cpus must be > 0, got {replica_num_cpus!r}")
    if max_ongoing_requests is None:
        max_ongoing_requests = spec.engine_config.get("max_num_seqs", 128) + spec.max_waiting_requests
    actor_options: dict = {"num_cpus": replica_num_cpus}
    if runtime_env:
        actor_options["runtime_env"] = runtime_env
    options: dict = {
        "name": ENGINE_DEPLOYMENT, "ray_actor_options": actor_options, "max_ongoing_requests": max_ongoing_requests,
        "health_check_period_s": health_check_period_s, "health_check_timeout_s": max(30.0, health_check_period_s),
        "graceful_shutdown_timeout_s": 10.0, "logging_config": _QUIET,
    }
    if autoscaling_config is not None:
        config = check_autoscaling_config(autoscaling_config)
        if "initial_replicas" not in config:  # num_replicas, within the config's bounds
            low, high = config.get("min_replicas", 1), config.get("max_replicas", num_replicas)
            config["initial_replicas"] = min(max(num_replicas, low), max(low, high))
        options["autoscaling_config"] = check_autoscaling_config(config)
    else:
        options["num_replicas"] = num_replicas
    if routing == "prefix":
        from hf_paged.serving.ray_router import PrefixAwareRouter

        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAwareRouter,
            request_router_kwargs={"imbalance_factor": imbalance_factor, "imbalance_slack": imbalance_slack},
        )
    engine = serve.deployment(EngineReplica).options(**options).bind(spec, report_period)
    ingress = serve.deployment(Ingress).options(
        name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=100_000, logging_config=_QUIET,
        ray_actor_options={"num_cpus": 0, **({"runtime_env": runtime_env} if runtime_env else {})},
    )
    return ingress.bind(engine, stale_after=max(15.0, 5 * report_period))


def wait_until_running(name: str = APP_NAME, timeout: float = 600.0) -> None:
    """Block until the application is RUNNING (every replica built and healthy); raise if it failed to deploy."""
    _, serve = require_ray()
    deadline = time.time() + timeout
    while True:
        app = serve.status().applications.get(name)
        status = getattr(app, "status", None)
        if status == "RUNNING":
            return
        if status == "DEPLOY_FAILED":  # UNHEALTHY passes: Ray is replacing a replica
            raise RuntimeError(f"the application {name!r} failed to deploy: {app.message}")
        if time.time() > deadline:
            raise TimeoutError(f"the application {name!r} is not running after {timeout:.0f} s (status {status})")
        time.sleep(0.5)


def run_replicas(app, *, host: str, port: int, ray_address: str | None = None, num_cpus: int | None = None,
                 on_ready=None) -> None:
    """Serve ``app`` on ``http://host:port`` until interrupted (Ctrl-C), then remove what this call started.

    Without ``ray_address`` a local Ray instance is started (no dashboard) and shut down at the end; with it
    (``"auto"`` or ``"HOST:6379"``) the application joins that cluster and is deleted from it at the end.
    """
    ray, serve = require_ray()
    local = ray_address is None
    stop = threading.Event()  # Ctrl-C / SIGTERM, whatever handler Ray installed meanwhile
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    ray.init(address=ray_address, include_dashboard=False if local else None, num_cpus=num_cpus if local else None,
             logging_level=logging.WARNING)
    try:
        for sig in previous:
            signal.signal(sig, lambda *_: stop.set())
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        wait_until_running(APP_NAME)
        if on_ready is not None:
            on_ready()
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:  # during start-up, before our handlers
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:  # graceful, but bounded: a local instance's ray.shutdown() ends every replica anyway
            graceful = threading.Thread(target=serve.shutdown if local else lambda: serve.delete(APP_NAME), daemon=True)
            graceful.start()
            graceful.join(30.0)
        finally:
            ray.shutdown()
