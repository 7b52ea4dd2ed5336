"""Running an ASGI app (the OpenAI server of :mod:`hf_paged.serving.server`) with uvicorn: in the foreground until
interrupted (``hf-paged serve``), or from a background thread (tests, benchmarks)."""

from __future__ import annotations

import time


def _uvicorn():
    try:
        import uvicorn
    except ImportError as e:
        raise ImportError("the server needs uvicorn: pip install hf-paged[serve]") from e
    return uvicorn


def run_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn until interrupted."""
    _uvicorn().run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)


class BackgroundServer:
    """Serve an app with uvicorn from a background thread (tests, benchmarks); ``port=0`` picks a free port.

    Example:
        >>> with BackgroundServer(app) as server:
        ...     client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import socket
        import threading

        uvicorn = _uvicorn()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        config = uvicorn.Config(app, log_level=log_level, timeout_keep_alive=30, backlog=4096)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="hf-paged-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
