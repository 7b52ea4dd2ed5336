"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over an :class:`~hf_paged.serving.AsyncPagedEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream`` as server-sent events),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). Errors use OpenAI's JSON shape. A client
that disconnects has its requests aborted, which frees their KV blocks. Needs ``pip install hf-paged[serve]``.
"""

# No ``from __future__ import annotations``: FastAPI reads the route signatures' annotations as objects.
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator

from hf_paged.outputs import RequestOutput
from hf_paged.serving.common import WorkerPool
from hf_paged.serving.engine_loop import AsyncPagedEngine, EngineClosedError, EngineFailedError, QueueFullError
from hf_paged.serving.http_runner import BackgroundServer, run_server  # noqa: F401 - served from here too
from hf_paged.serving.lora_routes import install_lora_routes, model_cards
from hf_paged.serving.openapi import install_openapi
from hf_paged.serving.protocol import APIError, ParsedRequest, ServedModel, check_body, parse_chat, parse_completion
from hf_paged.serving.responses import chat_logprobs, completion_logprobs, new_id, usage
from hf_paged.serving.structured import compile_grammar, generation_error, needs_compile
from hf_paged.serving.stream import RequestStream

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_REQUEST_WORKERS = 2  # threads that parse and tokenize request bodies
DEFAULT_MAX_PENDING_COMPILES = 16  # requests waiting for (or in) the one grammar compile thread; more are 503s
# SamplingParams fields an engine error message may start with (longest first: "stop_token_ids" before "stop")
_PARAM_FIELDS = ("stop_token_ids", "max_tokens", "min_tokens", "logprobs", "stop", "seed", "n")


def _require():
    try:
        import fastapi
        import starlette  # noqa: F401
    except ImportError as e:  # optional dependency
        raise ImportError("the server needs fastapi and uvicorn: pip install hf-paged[serve]") from e
    return fastapi


def build_app(
    engine: AsyncPagedEngine, served: ServedModel, *, api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, enable_metrics: bool = True,
    request_workers: int = DEFAULT_REQUEST_WORKERS, max_pending_compiles: int = DEFAULT_MAX_PENDING_COMPILES,
):
    """The FastAPI app serving ``engine`` under the OpenAI API.

    Args:
        engine: The running engine loop (the app does not shut it down).
        served: The model's name (what ``model`` must be), tokenizer and limits. Its ``max_prompts`` (prompts in
            one completions call) is capped at the engine's ``max_waiting_requests``, and is that by default.
        api_key: When set, ``/v1/*`` requests need ``Authorization: Bearer <api_key>`` (401 otherwise).
        max_body_bytes: Larger request bodies are refused with a 413.
        enable_metrics: Serve Prometheus metrics at ``/metrics``.
        request_workers: Threads that parse request bodies, apply the chat template and tokenize, off the
            event loop (so a huge message never stalls other clients). At most ``max_waiting_requests``
            requests wait for them; one more is a 503.
        max_pending_compiles: Requests whose structured-output grammar is not cached wait for one compile thread
            (so a big schema never holds up the request workers, and at most one compile at a time takes CPU from
            the engine); at most this many wait or compile, one more is a 503. A client that disconnects meanwhile
            stops its compile (see the engine's ``structured_compile_timeout_s``).
    """
    fastapi = _require()
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.responses import JSONResponse, Response, StreamingResponse

    from hf_paged.serving.metrics import ServingMetrics

    queue = engine.max_waiting_requests
    served = dataclasses.replace(served, max_prompts=min(served.max_prompts or queue, queue))
    pool = WorkerPool(request_workers, queue)
    compiles = WorkerPool(1, max_pending_compiles, what="requests are waiting for their grammar to compile")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        try:
            yield
        finally:
            pool.close()
            compiles.close()

    app = fastapi.FastAPI(title="hf_paged OpenAI-compatible server", docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = ServingMetrics(engine, served.name, pool, compiles) if enable_metrics else None
    app.state.engine = engine
    app.state.served = served
    app.state.metrics = metrics

    def error_response(err: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if err.status in (429, 503) else None
        return JSONResponse(err.to_dict(), status_code=err.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(_request, err: APIError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, err):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        response = error_response(APIError(str(err.detail), err.status_code, type=kind))
        response.headers.update(err.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _internal_error(_request, err: Exception):
        logger.exception("request failed")
        return error_response(APIError(f"internal error: {type(err).__name__}: {err}", 500, type="server_error"))

    def check_key(request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError("Incorrect API key provided", 401, type="authentication_error", code="invalid_api_key")

    async def read_body(request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise APIError(f"the request body has {length} bytes, more than the limit of {max_body_bytes}", 413,
                           param="body", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise APIError(f"the request body is larger than the limit of {max_body_bytes} bytes", 413,
                               param="body", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def parse_json(raw: bytes) -> object:
        try:
            body = json.loads(raw)
        except RecursionError as e:  # the parser recursed past Python's limit
            raise APIError("the request body is nested too deeply to parse", param="body") from e
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}", param="body") from e
        check_body(body)
        return body

    def submit(parsed: ParsedRequest, rid: str) -> list[RequestStream]:
        """Queue every prompt of the request, or none (a refused request leaves nothing to abort)."""
        ids = [f"{rid}-{i}" for i in range(len(parsed.prompts))]
        try:
            lora = served.lora_modules.get(parsed.model)
            streams = engine.add_requests(parsed.prompts, parsed.params, ids, parsed.priority, lora_request=lora)
            if metrics is not None:
                metrics.count_model(parsed.model if lora is not None else served.name, len(ids))
            return streams
        except QueueFullError as e:
            raise APIError(str(e), 503, type="server_overloaded", code="queue_full") from e
        except EngineFailedError as e:
            raise APIError(str(e), 503, type="server_error", code="engine_failed") from e
        except EngineClosedError as e:
            raise APIError(str(e), 503, type="server_error", code="engine_closed") from e
        except (ValueError, TypeError) as e:  # the engine's own checks: name the field its message names
            message = str(e)
            field = next((f for f in _PARAM_FIELDS if message.startswith(f + " ") or message.startswith(f + "=")),
                         "messages" if parsed.kind == "chat" else "prompt")
            raise APIError(message, 400, param=field) from e

    async def handle(request, kind: str):
        check_key(request)
        raw = await read_body(request)
        parse = parse_chat if kind == "chat" else parse_completion
        try:  # JSON, the chat template and tokenization take time with size: a worker thread runs them
            parsed = await pool.run(lambda: compile_grammar(engine, parse(parse_json(raw), served), cached_only=True))
        except QueueFullError as e:
            raise APIError(str(e), 503, type="server_overloaded", code="queue_full") from e
        del raw
        if needs_compile(parsed):
            parsed = await compile_or_leave(request, parsed)
            if parsed is None:  # the client went away: its compile was stopped
                return Response(status_code=499)
        rid = new_id(kind)
        streams = submit(parsed, rid)
        created = int(time.time())
        if parsed.stream:
            return _SSEResponse(sse_events(parsed, rid, created, streams), streams)
        try:
            results = await _until_disconnected(request, asyncio.gather(*(s.aresult() for s in streams)))
        finally:
            _abort_all(streams)
        if results is None:  # the client went away: its requests were aborted
            return Response(status_code=499)
        return JSONResponse(full_response(parsed, rid, created, results))

    async def compile_or_leave(request, parsed: ParsedRequest) -> ParsedRequest | None:
        """The request with its grammar compiled on the compile thread, or None if the client disconnected
        first (then its compile is stopped, or never starts)."""
        cancel = threading.Event()
        try:
            return await _until_disconnected(request, compiles.run(compile_grammar, engine, parsed, cancel))
        except QueueFullError as e:
            raise APIError(str(e), 503, type="server_overloaded", code="queue_full") from e
        finally:
            cancel.set()  # a no-op once it compiled; after a disconnect, it kills the compile

    def choice(parsed: ParsedRequest, c, index: int, stream: bool, offset: int = 0, text: str | None = None) -> dict:
        """One choice of a response (``stream``: a chunk's delta), OpenAI's fields in OpenAI's order; a tool
        call is the whole output ``text``, once (streamed: in the last chunk)."""
        k = parsed.logprobs or 0
        finish_reason = c.finish_reason
        if parsed.kind == "chat":
            if parsed.tools is not None:
                build = parsed.tools.delta if stream else parsed.tools.message
                message, finish_reason = build(c.text if text is None else text, c.finish_reason)
                body = {"delta" if stream else "message": message}
            elif stream:
                body = {"delta": {"content": c.text or ""} if c.text or c.token_ids else {}}
            else:
                body = {"message": {"role": "assistant", "content": c.text or ""}}
            logprobs = chat_logprobs(served.tokenizer, c.token_ids, c.logprobs, k)
        else:
            body = {"text": c.text or ""}
            logprobs = completion_logprobs(served.tokenizer, c.token_ids, c.logprobs, k, offset)
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}

    def full_response(parsed: ParsedRequest, rid: str, created: int, results: list[RequestOutput]) -> dict:
        choices, completion_tokens = [], 0
        for i, out in enumerate(results):
            for c in out.outputs:
                if c.finish_reason == "error":
                    raise generation_error(parsed, c.error)
                completion_tokens += len(c.token_ids)
                index = i * parsed.params.n + c.index
                choices.append(choice(parsed, c, index, stream=False))
        prompt_tokens = sum(len(o.prompt_token_ids) for o in results)
        cached = sum(o.num_cached_tokens for o in results)
        return {
            "id": rid, "object": "chat.completion" if parsed.kind == "chat" else "text_completion",
            "created": created, "model": parsed.model, "system_fingerprint": None, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached),
        }

    async def sse_events(parsed: ParsedRequest, rid: str, created: int, streams: list[RequestStream]) -> AsyncIterator[bytes]:
        chat = parsed.kind == "chat"
        n = parsed.params.n
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": parsed.model}
        if chat:
            base["system_fingerprint"] = None
        extra = {"usage": None} if parsed.include_usage else {}

        def event(choices: list[dict]) -> bytes:
            return b"data: " + json.dumps({**base, "choices": choices, **extra}).encode() + b"\n\n"

        if chat:  # the role comes first, as OpenAI sends it
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(streams) * n)])
        queue: asyncio.Queue = asyncio.Queue()
        offsets = [0] * (len(streams) * n)
        texts = [""] * (len(streams) * n)  # tool calls: the output so far, sent whole at the end
        ended: set[int] = set()  # choices whose finish_reason was sent (later deltas still carry it)

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for delta in stream:
                    await queue.put((i, delta))
            except BaseException as e:  # noqa: BLE001 - reported to the reader
                await queue.put((i, e))
                raise

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            prompt_tokens = completion_tokens = cached = 0
            while remaining:
                i, delta = await queue.get()
                if isinstance(delta, BaseException):
                    raise delta
                choices = []
                for c in delta.outputs:
                    index = i * n + c.index
                    if c.finish_reason == "error":
                        err = generation_error(parsed, c.error)
                        yield b"data: " + json.dumps(err.to_dict()).encode() + b"\n\n"
                        yield b"data: [DONE]\n\n"
                        return
                    if (not c.token_ids and not c.text and c.finish_reason is None) or index in ended:
                        continue
                    if c.finish_reason is not None:
                        ended.add(index)
                    completion_tokens += len(c.token_ids)
                    if parsed.tools is not None:
                        texts[index] += c.text or ""
                        if c.finish_reason is None:
                            continue
                    choices.append(choice(parsed, c, index, stream=True, offset=offsets[index], text=texts[index]))
                    offsets[index] += len(c.text or "")  # completions' text_offset
                if choices:
                    yield event(choices)
                if delta.finished:
                    remaining -= 1
                    prompt_tokens += len(delta.prompt_token_ids)
                    cached += delta.num_cached_tokens
            if parsed.include_usage:
                final = {**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached)}
                yield b"data: " + json.dumps(final).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            _abort_all(streams)

    class _SSEResponse(StreamingResponse):
        """Server-sent events that abort their requests however the response ends (disconnect included)."""

        def __init__(self, content, streams: list[RequestStream]) -> None:
            super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            self._streams = streams

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                _abort_all(self._streams)

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        return await handle(request, "chat")

    @app.get("/v1/models")
    async def models(request: fastapi.Request):
        check_key(request)
        return {"object": "list", "data": [{
            "id": served.name, "object": "model", "created": served.created, "owned_by": "hf_paged",
            "root": served.name, "max_model_len": served.max_model_len,
        }, *model_cards(served)]}

    @app.get("/health")
    async def health():
        failure = engine.failure
        if failure is not None:  # for good: the server exits (hf-paged serve) or its supervisor replaces it
            return JSONResponse({"status": "engine failed", "error": failure}, status_code=503)
        if not engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        if metrics is None:
            raise APIError("metrics are disabled on this server", 404, type="not_found_error")
        return Response(await metrics.render(), media_type=metrics.content_type)

    install_lora_routes(app, engine, served, check_key, read_body, pool)
    install_openapi(app, served, api_key is not None)
    return app


def _abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        if not stream.finished:
            stream.abort()


async def _until_disconnected(request, awaitable):
    """Await ``awaitable`` unless the client disconnects first (then cancel it and return None)."""
    work = asyncio.ensure_future(awaitable)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if watch.done() and not watch.cancelled():
            watch.exception()
        if not work.done():
            work.cancel()
        # Wait for the cancelled work to wind down (its readers abort their requests) and retrieve its outcome,
        # so that asyncio never logs "exception was never retrieved" for it.
        await asyncio.wait({work})
        if not work.cancelled():
            work.exception()
    if work in done:
        return work.result()
    return None
