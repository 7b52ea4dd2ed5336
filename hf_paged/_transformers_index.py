"""transformers' table of its model modules, kept across runs.

On import, transformers builds the table its lazy modules answer from (``transformers.utils.import_utils.
create_import_structure_from_path`` on its ``models`` folder): it reads the source of every file of every model
folder, ~3,000 files in ~560 folders in transformers 5.24, for their ``__all__`` lists and backend requirements.
That is ~1 s of every start of a process on our 2-core hosts (a quarter of importing transformers' Llama
classes), and the same answer each time. This module keeps the table in ``<cache dir>/transformers/`` under a key
of transformers' version and the name, size and modification time of every file in that folder (a changed,
added or removed file makes a new table), and answers the next start from it.

:func:`install` (``import hf_paged`` calls it) puts a finder on ``sys.meta_path`` that, when
``transformers.utils.import_utils`` is first imported, wraps that one function for that one folder; every other
call goes to transformers' own function. Nothing happens where transformers is imported already, and
``HF_PAGED_TRANSFORMERS_INDEX=0`` turns it off. Any failure (an unreadable file, a transformers without that
function) falls back to transformers' own scan. Standard library only: ``import hf_paged`` stays light.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import logging
import os
import pickle
import sys
import tempfile

from hf_paged.env import cache_dir

logger = logging.getLogger(__name__)

ENV = "HF_PAGED_TRANSFORMERS_INDEX"
TARGET = "transformers.utils.import_utils"
FUNCTION = "create_import_structure_from_path"
KEEP = 4  # tables kept in the store


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def install() -> None:
    """Wrap transformers' model-table scan when transformers is first imported (see the module docstring)."""
    if not enabled() or TARGET in sys.modules or any(type(f) is _Finder for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``transformers.utils.import_utils`` as the path finder does, and patches it once it has run."""

    done = False

    def find_spec(self, name, path, target=None):
        if name != TARGET or self.done:
            return None
        self.done = True  # once per process (removed from sys.meta_path once the module has run)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # (None: the other finders look)
        run = loader.exec_module

        def exec_module(module):
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            run(module)
            try:
                patch(module)
            except Exception as e:  # noqa: BLE001 (transformers' own scan stays in place)
                logger.debug("transformers' model table is not cached: %s", e)

        loader.exec_module = exec_module
        return spec


def patch(module) -> None:
    """Replace ``module``'s scan (``transformers.utils.import_utils``) by one that answers for the ``models``
    folder from the stored table."""
    original = getattr(module, FUNCTION, None)
    version = getattr(sys.modules.get("transformers"), "__version__", None)
    if original is None or not isinstance(version, str):
        return
    models = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(module.__file__))), "models")
    held: dict[str, dict] = {}

    @functools.wraps(original)
    def scan(module_path):
        path = os.fspath(module_path)
        if os.path.isfile(path):
            path = os.path.dirname(path)
        if os.path.normpath(os.path.abspath(path)) != models:
            return original(module_path)
        if "table" not in held:
            held["table"] = table(models, version, original)
        return held["table"]

    setattr(module, FUNCTION, scan)


def signature(folder: str) -> str:
    """A digest of the name, size and modification time of every file under ``folder`` (``__pycache__`` aside)."""
    h = hashlib.sha1()
    pending = [folder]
    while pending:
        current = pending.pop()
        with os.scandir(current) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.name == "__pycache__":
                    continue
                if entry.is_dir():
                    pending.append(entry.path)
                else:
                    st = entry.stat()
                    h.update(f"{entry.path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def table(models: str, version: str, scan):
    """The table of ``models`` from the store, else ``scan(models)`` (then stored)."""
    folder = cache_dir() / "transformers"
    path = folder / f"import-structure-{version}-{signature(models)}.pickle"
    try:
        with open(path, "rb") as f:
            value = pickle.load(f)
        if isinstance(value, dict) and value:
            return value
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001
        logger.warning("ignoring transformers' stored model table %s (%s); it is built again", path, e)
    value = scan(models)
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        tmp = None
        # the newest few tables stay (other versions or installs of transformers sharing this cache)
        stored = sorted(folder.glob("import-structure-*.pickle"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in stored[KEEP:]:
            old.unlink(missing_ok=True)
    except (OSError, pickle.PicklingError) as e:
        logger.debug("transformers' model table not stored (%s)", e)
    finally:
        if tmp is not None:
            os.unlink(tmp)
    return value
