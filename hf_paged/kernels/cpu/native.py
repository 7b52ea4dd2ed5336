"""Build and load the project's C kernels (``csrc/*.c``) with the host compiler, once per machine.

Each library is compiled on first use with ``$CC`` (else ``cc``/``gcc``/``clang``) and ``-O3 -march=native
-fopenmp`` (``HF_PAGED_ISA=avx2`` / ``avx512``: that level's target instead, :mod:`hf_paged.kernels.cpu.isa`) into the user
cache dir, keyed by its source, the flags and the CPU, and loaded with ctypes. The
build is time-limited (``HF_PAGED_CC_TIMEOUT`` seconds, default 120); ``HF_PAGED_NO_NATIVE=1`` turns every
native kernel off. A library that cannot be built is None, with a one-line reason, and callers keep their
pure-torch path. OpenMP comes from libgomp.so.1, the runtime torch's own threads use in the same process.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from hf_paged.kernels.cpu import isa
from hf_paged.env import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")  # + the ISA level's target (isa.march_flags())


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_key() -> str:
    return isa.cache_key() if isa.host_flags() else os.uname().machine


def _last_line(text: str) -> str:
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "unknown error"


@functools.lru_cache(maxsize=None)
def sources_digest() -> str:
    """A hash of every C source and header in ``csrc/``: measured kernel timings are only valid for this code."""
    h = hashlib.sha1()
    for f in sorted(CSRC.glob("*.[ch]")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


class NativeLibrary:
    """One C source of ``csrc/``, built and loaded on first :meth:`load`.

    Args:
        source: File name in ``csrc/``.
        functions: Exported function name -> (restype, argtypes) for ctypes.
        extra_flags: Compiler flags beyond :data:`CFLAGS`.
        what: How log messages name the kernels (``"the native CPU attention kernel"``).
    """

    def __init__(self, source: str, functions: dict[str, tuple], extra_flags: tuple[str, ...] = (), what: str = "") -> None:
        self.source = CSRC / source
        self.functions = functions
        self.extra_flags = extra_flags
        self.what = what or self.source.stem
        self.why = ""  # why the library is missing
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._lock = threading.Lock()

    @property
    def flags(self) -> tuple[str, ...]:
        """The compiler flags at the current ISA level (ValueError for a bad ``HF_PAGED_ISA``)."""
        return (*CFLAGS, *isa.march_flags(), *self.extra_flags)

    def _build(self, cc: str) -> Path:
        src = self.source.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # its includes
        key = hashlib.sha1(src + " ".join([cc, *self.flags, _cpu_key()]).encode()).hexdigest()[:16]
        target = cache_dir() / "kernels" / f"{self.source.stem}-{key}.so"
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run(
                [cc, *self.flags, str(self.source), "-o", tmp, "-lm"], check=True, capture_output=True, text=True,
                timeout=float(os.environ.get("HF_PAGED_CC_TIMEOUT", "120")), stdin=subprocess.DEVNULL,
            )
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return target

    def load(self) -> ctypes.CDLL | None:
        """The loaded library, building it once per machine; None (see :attr:`why`) if it cannot be built here."""
        if self._tried:
            return self._lib
        with self._lock:
            if self._tried:
                return self._lib
            isa.forced_level()  # a bad HF_PAGED_ISA is the caller's error, raised every time, never a silent miss
            self._tried = True
            if os.environ.get("HF_PAGED_NO_NATIVE") == "1":
                self.why = "disabled by HF_PAGED_NO_NATIVE=1"
                return None
            cc = compiler()
            if cc is None:
                self.why = "no C compiler found ($CC, cc, gcc, clang)"
                logger.warning("%s: %s is off, the pure-torch path runs instead", self.why, self.what)
                return None
            try:
                lib = ctypes.CDLL(str(self._build(cc)))
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", "") or str(e)
                if isinstance(e, subprocess.TimeoutExpired):
                    self.why = f"building with {cc} timed out after {e.timeout:g} s (HF_PAGED_CC_TIMEOUT)"
                elif isinstance(e, subprocess.CalledProcessError):
                    self.why = f"building with {cc} failed (exit code {e.returncode}): {_last_line(detail or 'no output')}"
                else:
                    self.why = f"building with {cc} failed: {_last_line(detail)}"
                logger.warning("building %s failed, using the torch path: %s", self.what, detail[-2000:])
                return None
            for name, (restype, argtypes) in self.functions.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
            self._lib = lib
            return lib

    def reset(self) -> None:
        """Forget the loaded library, so the next :meth:`load` builds (or finds the build) again (for tests)."""
        with self._lock:
            self._lib, self._tried, self.why = None, False, ""
