"""The OpenAI-compatible server on Ray Serve: N engine replicas behind one ingress, routed by prompt prefix.

- ``EngineReplica`` (deployment ``Engine``): one engine loop and the very FastAPI app of ``hf-paged serve``;
  it answers the HTTP requests the ingress forwards (``http``, streamed back chunk by chunk), reports its
  Prometheus text to the ingress every ``report_period`` seconds, and fails Ray's health check
  (``check_health``) when its loop has stopped or its engine failed, so that Ray replaces it.
- ``Ingress`` (deployment ``Ingress``, one replica): receives HTTP from Ray's proxy, computes the request's
  prefix chain (``prefix_routing``), forwards it to an engine replica through a ``DeploymentHandle`` whose
  request router is ``PrefixAwareRouter`` (or Ray's default power-of-two choices), and serves the merged
  ``/metrics``. A request whose replica dies before any byte of its answer was sent is retried once on another
  replica; a stream cut by a dying replica ends with an error event.

Needs ``pip install hf-paged[ray]``; docs/scaling.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from hf_paged.serving.asgi_call import HTTPRequest, ResponseHead, call_asgi
from hf_paged.serving.prefix_routing import prefix_hashes, routing_text
from hf_paged.serving.ray_metrics import MetricsBoard

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "Engine"
INGRESS_DEPLOYMENT = "Ingress"
REPLICA_HEADER = "x-hf-paged-replica"  # which engine replica answered (names its Ray actor too)
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
ROUTING_POLICIES = ("prefix", "pow2")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection"}


def require_ray():
    try:
        import ray
        from ray import serve
    except ImportError as e:  # optional dependency
        raise ImportError("replicas need Ray Serve: pip install hf-paged[ray]") from e
    return ray, serve


@dataclass
class EngineSpec:
    """How each replica builds its engine and app (plain data: it is shipped to every replica).

    Attributes:
        model: A local model folder; None is the default model.
        dtype, quantization: As ``hf-paged serve``'s flags.
        engine_config: ``PagedGenerator`` keywords (``max_num_seqs``, ``max_model_len``, ...); with
            ``tensor_parallel_size`` N > 1 each replica spawns its N - 1 worker ranks, which load their shards.
        loader: Instead of ``model``, a picklable callable returning ``(model, tokenizer)`` (tests).
    """

    model: str | None = None
    dtype: str = "fp32"
    quantization: str | None = None
    engine_config: dict = field(default_factory=dict)
    max_waiting_requests: int = 1024
    served_model_name: str | None = None
    api_key: str | None = None
    request_workers: int = 2
    loader: Callable[[], tuple] | None = None

    def name(self) -> str:
        import os

        from hf_paged.model.default_model import DEFAULT_MODEL_NAME

        if self.served_model_name:
            return self.served_model_name
        return os.path.basename(os.path.normpath(self.model)) if self.model else DEFAULT_MODEL_NAME

    def load(self):
        if self.loader is not None:
            return self.loader()
        from hf_paged.model.default_model import load_default, load_model

        if self.model:
            return load_model(self.model, dtype=self.dtype)
        return load_default(dtype=self.dtype, quantized=self.quantization == "gguf")

    def build_app(self):
        """The engine loop and its FastAPI app, as ``hf-paged serve`` builds them."""
        from hf_paged import PagedGenerator
        from hf_paged.serving import AsyncPagedEngine
        from hf_paged.serving.protocol import ServedModel
        from hf_paged.serving.server import build_app

        config = dict(self.engine_config)
        if self.quantization in ("int8", "int4"):
            config["quantization"] = self.quantization
        if config.get("tensor_parallel_size", 1) > 1 and self.loader is None:  # every rank loads its own shard
            from transformers import AutoTokenizer

            from hf_paged.model.default_model import default_model_path

            path = self.model or str(default_model_path())
            tokenizer = AutoTokenizer.from_pretrained(path)
            engine = PagedGenerator.from_pretrained(path, tokenizer, dtype=self.dtype, **config)
        else:
            model, tokenizer = self.load()
            engine = PagedGenerator(model, tokenizer, **config)
        loop = AsyncPagedEngine(engine, max_waiting_requests=self.max_waiting_requests)
        name = self.name()
        aliases = tuple(a for a in (self.model,) if a and a != name)
        served = ServedModel(name, tokenizer, loop.max_model_len, loop.engine.config.max_num_seqs, aliases)
        return loop, build_app(loop, served, api_key=self.api_key, request_workers=self.request_workers)


class EngineReplica:
    """One engine replica (wrapped by ``serve.deployment`` in :func:`build_application`)."""

    def __init__(self, spec: EngineSpec, report_period: float = 1.0) -> None:
        _, serve = require_ray()
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.loop, self.app = spec.build_app()
        self._ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, context.app_name)
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report, args=(report_period,), daemon=True,
                                          name="hf-paged-metrics-report")
        self._reporter.start()

    async def http(self, request: HTTPRequest, prefix_hashes: list[int] | None = None):
        """The app's answer to ``request``: a :class:`ResponseHead`, then body chunks (``prefix_hashes`` is
        for the router)."""
        async for item in call_asgi(self.app, request):
            if isinstance(item, ResponseHead):
                item.headers.append((REPLICA_HEADER, self.replica_id))
            yield item

    def check_health(self) -> None:
        """Ray Serve calls this every ``health_check_period_s``; raising has the replica replaced."""
        if self.loop.failure is not None:  # for good (e.g. a tensor-parallel worker died): a new replica serves
            raise RuntimeError(f"replica {self.replica_id}: {self.loop.failure}")
        if not self.loop.is_running:
            raise RuntimeError(f"the engine loop of replica {self.replica_id} has stopped")

    def _report(self, period: float) -> None:
        metrics = self.app.state.metrics
        while not self._stop.wait(period):
            try:
                text = metrics.render_blocking().decode()
                self._ingress.report.remote(self.replica_id, text).result(timeout_s=10)
            except Exception:  # noqa: BLE001 - the ingress may be starting or restarting: next period
                logger.debug("metrics report failed", exc_info=True)

    def __del__(self) -> None:  # Ray Serve calls it when the replica is shut down
        if hasattr(self, "_reporter"):  # (not when __init__ failed halfway)
            self._stop.set()
            try:
                self._ingress.report.remote(self.replica_id, None)
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        if hasattr(self, "loop"):
            self.loop.shutdown()


def _replica_gone_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    return RayActorError, ReplicaUnavailableError


def _error_body(message: str, status: int, code: str) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class Ingress:
    """The HTTP entry point (wrapped by ``serve.deployment``): routing, retries, merged metrics."""

    def __init__(self, engine, max_body_bytes: int = 4 * 2**20, stale_after: float = 15.0) -> None:
        self.engine = engine.options(stream=True)
        self.max_body_bytes = max_body_bytes
        self.board = MetricsBoard(stale_after)

    def report(self, replica: str, text: str | None) -> None:
        self.board.report(replica, text)

    async def __call__(self, request):
        from starlette.responses import Response

        if request.url.path == "/metrics" and request.method == "GET":
            return Response(self.board.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
        body = await self._read_body(request)
        if isinstance(body, Response):
            return body
        hashes: list[int] = []
        if request.method == "POST" and request.url.path in ROUTED_PATHS:
            hashes = await asyncio.to_thread(_routing_hashes, request.url.path, body) if len(body) > 65536 \
                else _routing_hashes(request.url.path, body)
        forwarded = HTTPRequest(request.method, request.url.path, request.url.query,
                                [(k, v) for k, v in request.headers.items()], body)
        return await self._forward(forwarded, hashes)

    async def _read_body(self, request):
        from starlette.responses import Response

        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                message = f"the request body is larger than the limit of {self.max_body_bytes} bytes"
                return Response(_error_body(message, 413, "request_too_large"), status_code=413,
                                media_type="application/json")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _forward(self, request: HTTPRequest, hashes: list[int]):
        from starlette.responses import Response, StreamingResponse

        gone = _replica_gone_errors()
        for attempt in (1, 2):
            stream = self.engine.http.remote(request, prefix_hashes=hashes)
            try:
                head = await stream.__anext__()
                if not head.is_stream:  # a whole body: nothing reached the client yet, so a retry is safe
                    body = b"".join([chunk async for chunk in stream])
                    return Response(body, status_code=head.status, headers=_headers(head))
            except asyncio.CancelledError:  # the client went away: stop the replica's work
                stream.cancel()
                raise
            except gone as e:
                if attempt == 1:
                    logger.warning("the replica of %s %s died before answering; retrying once: %s",
                                   request.method, request.path, e)
                    continue
                message = f"the engine replica serving this request died twice before answering ({e}); retry later"
                return Response(_error_body(message, 503, "replica_died"), status_code=503,
                                media_type="application/json", headers={"Retry-After": "1"})
            return StreamingResponse(_relay(stream, gone), status_code=head.status, headers=_headers(head))
        raise AssertionError("unreachable: the loop returns on its second attempt")


def _routing_hashes(path: str, body: bytes) -> list[int]:
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return []  # the replica answers the JSON error
    return prefix_hashes(routing_text(path, parsed))


def _headers(head: ResponseHead) -> dict[str, str]:
    return {k: v for k, v in head.headers if k.lower() not in _HOP_HEADERS}


async def _relay(stream, gone):
    """A replica's server-sent events; a replica that dies mid-stream ends it with an OpenAI error event."""
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    except gone as e:
        message = f"the engine replica serving this stream died mid-answer ({e}); retry the request"
        yield b"data: " + _error_body(message, 503, "replica_died") + b"\n\n"
        yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:  # the client went away: stop the replica's work
            stream.cancel()
