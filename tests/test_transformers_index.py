"""transformers' table of its model modules kept across runs (hf_paged/_transformers_index.py): the stored table is
transformers' own scan, a second start reads it instead of scanning, a changed file makes a new one, a bad file is
built again, and the switch turns it off. transformers is imported already in this process, so a start is a child
process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hf_paged import _transformers_index as index

CHILD = r"""
import json, os, sys
import hf_paged, transformers
from transformers.utils import import_utils as iu
scan = iu.create_import_structure_from_path
models = os.path.join(os.path.dirname(transformers.__file__), "models")
wrapped = not hasattr(scan, "cache_info")  # ours is a plain function over transformers' lru_cache
original = scan.__wrapped__ if wrapped else scan
entries = original.cache_info().misses  # folders transformers' own scan read in this start
same = scan(models) == original.__wrapped__(models) if wrapped else None
from transformers import LlamaForCausalLM  # the lazy table answers
print(json.dumps({"wrapped": wrapped, "entries": entries, "same": same}))
"""


def _start(cache, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_PAGED_CACHE": str(cache), **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_start_reads_the_stored_table_which_is_transformers_own(tmp_path):
    first = _start(tmp_path)
    assert first["wrapped"] and first["same"]
    assert first["entries"] > 300  # it scanned every model folder once, and stored the table
    stored = list((tmp_path / "transformers").glob("import-structure-*.pickle"))
    assert len(stored) == 1
    second = _start(tmp_path)
    assert second["wrapped"] and second["same"]
    assert second["entries"] < 50  # only the few folders imported by name (llama, auto), not the whole tree
    off = _start(tmp_path / "off", HF_PAGED_TRANSFORMERS_INDEX="0")
    assert not off["wrapped"] and off["entries"] > 300
    assert not (tmp_path / "off" / "transformers").exists()


def test_the_key_follows_every_file_and_a_bad_store_is_rebuilt(tmp_path, monkeypatch, caplog):
    tree = tmp_path / "models"
    (tree / "llama").mkdir(parents=True)
    (tree / "llama" / "modeling_llama.py").write_text("__all__ = ['A']\n")
    (tree / "llama" / "__pycache__").mkdir()
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path / "cache"))
    calls = []

    def scan(path):
        calls.append(path)
        return {"llama": {frozenset(): {"modeling_llama": {"A"}}}}

    before = index.signature(str(tree))
    assert index.table(str(tree), "9.9", scan) == scan(None) and len(calls) == 2
    assert index.table(str(tree), "9.9", scan) == scan(None) and len(calls) == 3  # read back, not scanned
    (tree / "llama" / "__pycache__" / "x.pyc").write_bytes(b"0")
    assert index.signature(str(tree)) == before  # compiled files are not sources
    for change in (lambda: (tree / "llama" / "modeling_llama.py").write_text("__all__ = ['A', 'B']\n"),
                   lambda: (tree / "llama" / "configuration_llama.py").write_text(""),
                   lambda: (tree / "llama" / "configuration_llama.py").unlink()):
        change()
        assert index.signature(str(tree)) != before
        before = index.signature(str(tree))
    assert index.table(str(tree), "9.9", scan) and len(calls) == 4  # a new key: scanned
    assert index.signature(str(tree)) != index.signature(str(tmp_path))
    stored = (tmp_path / "cache" / "transformers") / f"import-structure-9.9-{before}.pickle"
    assert stored.exists()
    stored.write_bytes(b"not a pickle")
    assert index.table(str(tree), "9.9", scan) == scan(None) and len(calls) == 6
    assert "built again" in caplog.text
    assert index.table(str(tree), "9.9", scan) and len(calls) == 6  # rewritten, read back
    assert len(list(stored.parent.glob("*.pickle"))) <= index.KEEP and not list(stored.parent.glob("*.tmp"))
