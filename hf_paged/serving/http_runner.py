"""Running an ASGI app (the OpenAI server of :mod:`hf_paged.serving.server`) with uvicorn: in the foreground until
interrupted, or until its engine fails for good (``hf-paged serve``), or from a background thread (tests,
benchmarks)."""

from __future__ import annotations

import logging
import os
import threading
import time

logger = logging.getLogger(__name__)

ENGINE_FAILURE_EXIT_CODE = 1  # run_server's status when it stopped because the engine failed
STARTUP_FAILURE_EXIT_CODE = 3  # uvicorn's, when the server never started (e.g. the port is taken)
HARD_EXIT_AFTER_S = 10.0  # after the grace period: how long a graceful stop may take before the process just exits


def _uvicorn():
    try:
        import uvicorn
    except ImportError as e:
        raise ImportError("the server needs uvicorn: pip install hf-paged[serve]") from e
    return uvicorn


def run_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", *, engine=None,
               exit_grace_s: float | None = None) -> int:
    """Serve ``app`` with uvicorn until interrupted; returns the process exit status.

    Args:
        app: The ASGI app.
        host, port: Where to listen.
        log_level: uvicorn's log level.
        engine: The app's :class:`~hf_paged.serving.AsyncPagedEngine`, watched when ``exit_grace_s`` is set.
        exit_grace_s: Once ``engine`` failed for good (e.g. a tensor-parallel worker died), keep answering (503s,
            ``/health`` included) for this many seconds, then stop and return :data:`ENGINE_FAILURE_EXIT_CODE`, so
            that a supervisor (systemd, Kubernetes, Ray) restarts the server. None: serve on, answering 503s.

    Returns:
        0 when interrupted, :data:`ENGINE_FAILURE_EXIT_CODE` after an engine failure, or
        :data:`STARTUP_FAILURE_EXIT_CODE` when the server could not start.
    """
    uvicorn = _uvicorn()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30))
    watch = None
    if engine is not None and exit_grace_s is not None:
        watch = _ExitOnEngineFailure(engine, server, exit_grace_s)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if watch is not None and watch.fired:
        return ENGINE_FAILURE_EXIT_CODE
    return 0 if server.started else STARTUP_FAILURE_EXIT_CODE


class _ExitOnEngineFailure:
    """Stops a uvicorn server ``grace_s`` seconds after its engine failed for good (see :func:`run_server`), and
    ends the process (``exit``) if it is still there ``hard_exit_after_s`` seconds later."""

    def __init__(self, engine, server, grace_s: float, hard_exit_after_s: float = HARD_EXIT_AFTER_S,
                 exit=os._exit) -> None:
        self.fired = False
        self._hard_exit_after_s, self._exit = hard_exit_after_s, exit
        threading.Thread(target=self._watch, args=(engine, server, grace_s), name="hf-paged-exit-on-failure",
                         daemon=True).start()

    def _watch(self, engine, server, grace_s: float) -> None:
        failure = engine.wait_for_failure()
        logger.error("%s: the server stops in %g s and exits with status %d, for its supervisor to restart it "
                     "(--no-exit-on-engine-failure keeps it up)", failure, grace_s, ENGINE_FAILURE_EXIT_CODE)
        time.sleep(grace_s)
        self.fired = True
        server.should_exit = True
        # A graceful stop waits for open connections; a client holding one must not keep a dead server up.
        time.sleep(self._hard_exit_after_s)
        logger.error("the server did not stop within %g s of the grace period; exiting now", self._hard_exit_after_s)
        self._exit(ENGINE_FAILURE_EXIT_CODE)


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
