"""A killable grammar compile worker: a child process that tries each new spec under a time budget.

xgrammar compiles in C++ with no way to stop it, and its compile time grows steeply with some specs (measured
on a 2-core dev machine: a JSON schema with 400 optional properties compiles in 0.6 s, 800 in 6 s, 1,500 in
52 s; a single ``"maxLength": 256`` string takes 2-10 s). A compile on a thread of the engine's process would
run to its end whatever happened to its client. So each new spec is first compiled in this child process: if
it does not finish within the budget, or its caller gives up (a client that disconnected), the child is killed
and started again for the next spec. A spec the child compiled in time is then compiled again in the engine's
process, where it takes about as long (bounded by the budget): the compiled grammar is not sent back because
xgrammar's serialized form grows with the square of a schema's size (54 MB and 6 s to write and read for 400
optional properties, against 0.6 s to compile).
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time

logger = logging.getLogger(__name__)

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_child.py")
_POLL_S = 0.05  # how often a waiting caller checks its cancel event
START_TIMEOUT_S = 120.0  # the child imports xgrammar (and torch): about 3 s on a dev machine, more under load


class CompileCancelled(Exception):
    """The caller's cancel event was set (its client left) before its grammar finished compiling."""


class CompileTimeout(Exception):
    """The spec did not compile within the worker's budget; the child was killed."""


class CompileWorker:
    """One child process that compiles specs one at a time, each within ``timeout_s`` seconds.

    Args:
        tokenizer_info: The engine's ``xgrammar.TokenizerInfo`` (the child compiles against the same vocabulary).
        timeout_s: Seconds one spec may compile in the child (its start-up is not counted).
    """

    def __init__(self, tokenizer_info, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        fd, self._info_path = tempfile.mkstemp(prefix="hf-paged-tokenizer-info-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(tokenizer_info.serialize_json())
        self._lock = threading.Lock()  # one job in the child at a time
        self._proc: subprocess.Popen | None = None
        self._ready = False
        self._buffer = b""
        self.num_started = self.num_timeouts = self.num_cancelled = 0
        self.busy_since: float | None = None  # when the job now in the child was sent (None: idle)
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The child's process id (None before the first job or after a kill)."""
        return None if self._proc is None else self._proc.pid

    def check(self, method: str, source: str, cancel: threading.Event | None = None) -> str | None:
        """Compile ``source`` (``method``: "json_schema", "regex" or "grammar") in the child: None if it
        compiled in time, else xgrammar's error message.

        Raises:
            CompileTimeout: It ran past ``timeout_s``; the child was killed.
            ValueError: The child crashed on it.
            CompileCancelled: ``cancel`` was set first (while waiting for the worker or during the compile; a
                running compile's child is killed).
        """
        while not self._lock.acquire(timeout=_POLL_S):
            if cancel is not None and cancel.is_set():
                raise CompileCancelled("cancelled while waiting for the compile worker")
        try:
            if self._closed:
                raise RuntimeError("the grammar compile worker is closed")
            if cancel is not None and cancel.is_set():
                raise CompileCancelled("cancelled before its grammar started compiling")
            self._start(cancel)
            self._send({"method": method, "source": source})
            self.busy_since = time.monotonic()
            try:
                reply = self._receive(self.busy_since + self.timeout_s, cancel)
            finally:
                self.busy_since = None
            return None if reply.get("ok") else str(reply.get("error", "compile failed"))
        finally:
            if self._closed:  # closed meanwhile: no child outlives it (a replacement may have just started)
                self._kill()
            self._lock.release()

    def warm(self) -> None:
        """Start the child now if none runs, without waiting for it (a job in progress is left alone)."""
        if self._lock.acquire(blocking=False):
            try:
                if self._proc is None and not self._closed:
                    self._spawn()
            finally:
                self._lock.release()

    def close(self) -> None:
        """Kill the child and remove its tokenizer file (idempotent). A job running now ends at once with a
        RuntimeError: its caller is not waited for."""
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        if self._lock.acquire(blocking=False):  # else the running job reaps the child
            try:
                self._kill()
            finally:
                self._lock.release()
        try:
            os.unlink(self._info_path)
        except FileNotFoundError:
            pass

    # -- the child ------------------------------------------------------------------------------------
    def _start(self, cancel: threading.Event | None) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            self._kill()  # died since the last job
        if self._proc is None:
            self._spawn()
        if not self._ready:
            # a cancelled caller leaves a starting child to start: the next spec needs it too
            reply = self._receive(time.monotonic() + START_TIMEOUT_S, cancel, starting=True)
            if not reply.get("ready"):
                self._kill()
                raise RuntimeError(f"the grammar compile worker did not start: {reply}")
            self._ready = True

    def _spawn(self) -> None:
        self._proc = subprocess.Popen([sys.executable, _CHILD, self._info_path], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, bufsize=0)
        self._ready, self._buffer = False, b""
        self.num_started += 1

    def _replace(self) -> None:
        """Kill the child and start the next one now: it imports xgrammar (seconds) while no one waits for it."""
        self._kill()
        if not self._closed:
            self._spawn()

    def _send(self, message: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(message).encode() + b"\n")
            self._proc.stdin.flush()
        except OSError as e:  # the child died: the next job starts a new one
            self._kill()
            raise RuntimeError(f"the grammar compile worker exited ({e})") from None

    def _receive(self, deadline: float, cancel: threading.Event | None, starting: bool = False) -> dict:
        """The child's next reply line; kills it on the deadline or (during a compile) on ``cancel``."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            if cancel is not None and cancel.is_set():
                if not starting:
                    self._replace()
                    self.num_cancelled += 1
                raise CompileCancelled("the caller gave up while its grammar was compiling")
            now = time.monotonic()
            if now >= deadline:
                if starting:
                    self._kill()
                    raise RuntimeError(f"the grammar compile worker did not start within {START_TIMEOUT_S:g} s")
                self._replace()
                self.num_timeouts += 1
                raise CompileTimeout(f"compiling took longer than {self.timeout_s:g} s")
            readable, _, _ = select.select([fd], [], [], min(_POLL_S, deadline - now))
            if readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    code = self._proc.wait()
                    if self._closed or starting:
                        self._kill()
                        raise RuntimeError(f"the grammar compile worker exited with code {code}")
                    self._replace()  # it crashed on this spec, which would have taken the engine down with it
                    raise ValueError(f"the grammar compiler crashed on this spec (its process exited with code {code})")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _kill(self) -> None:
        proc, self._proc, self._ready, self._buffer = self._proc, None, False, b""
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
