"""Call an ASGI app in process with one buffered HTTP request and stream its response back.

An engine replica runs the same FastAPI app as ``hf-paged serve`` and answers the requests the ingress forwards
(method, path, headers, body) through it, so endpoints, streaming, errors and metrics stay one implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class HTTPRequest:
    """One buffered request, as the ingress forwards it (plain data: it crosses processes)."""

    method: str
    path: str
    query: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


@dataclass
class ResponseHead:
    status: int
    headers: list[tuple[str, str]]

    @property
    def is_stream(self) -> bool:
        return any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in self.headers)


async def call_asgi(app, request: HTTPRequest) -> AsyncIterator[ResponseHead | bytes]:
    """Yield the response's head, then its body chunks as the app sends them.

    Closing the iterator early (the client went away) tells the app the client disconnected, which aborts the
    requests it started, and then cancels the app's task.
    """
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method.upper(), "scheme": "http", "path": request.path,
        "raw_path": request.path.encode(), "query_string": request.query.encode(), "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": {},
    }

    async def run_app() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)  # the app returned (or raised): nothing more comes

    task = asyncio.ensure_future(run_app())
    complete = False
    try:
        while True:
            message = await messages.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield ResponseHead(message["status"], headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    complete = True
                    break
        if not complete:  # the app ended without a whole response: what it raised, or say so
            await task
            raise RuntimeError(f"the app sent no complete response to {request.method} {request.path}")
    finally:
        disconnected.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 5.0)  # let the app abort its requests
            task.cancel()
        elif not task.cancelled() and task.exception() is not None and complete:
            # Starlette re-raises after its error handler answered (a 500 in OpenAI's shape): already sent
            logger.debug("the app raised after its response", exc_info=task.exception())
