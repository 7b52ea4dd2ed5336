"""Old module paths of hf_paged, kept working for one release with a ``DeprecationWarning``.

The modules moved into packages by layer (issue #35). ``import hf_paged.generator`` still works: a finder on
``sys.meta_path`` answers each old dotted path with THE module at its new path (the same object, so
monkeypatching either name affects both and ``isinstance`` checks hold), and warns once per process and path.
Nothing of hf_paged's own imports an old path (``tests/test_layout.py`` checks it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# old dotted path -> new dotted path. Two old modules became packages that keep their old names working
# without this table: ``hf_paged.attention`` (looks the names of ``attention/function.py`` up on first use) and
# ``hf_paged.cli`` (re-exports ``main``, ``entry``, ``build_parser``; ``python -m hf_paged.cli`` runs).
MOVED: dict[str, str] = {
    "hf_paged.generator": "hf_paged.engine.generator",
    "hf_paged.generator_clients": "hf_paged.engine.generator_clients",
    "hf_paged.generator_loading": "hf_paged.engine.generator_loading",
    "hf_paged.generator_structured": "hf_paged.engine.generator_structured",
    "hf_paged.output_processor": "hf_paged.engine.output_processor",
    "hf_paged.detokenizer": "hf_paged.engine.detokenizer",
    "hf_paged.beam_search": "hf_paged.engine.beam_search",
    "hf_paged.engine_setup": "hf_paged.engine.engine_setup",
    "hf_paged.model_patches": "hf_paged.model.patches",
    "hf_paged.default_model": "hf_paged.model.default_model",
    "hf_paged.hf.gguf_loader": "hf_paged.model.gguf_loader",
    "hf_paged.sequence": "hf_paged.core.sequence",
    "hf_paged.sampling": "hf_paged.sample.sampling",
    "hf_paged.logits_processors": "hf_paged.sample.logits_processors",
    "hf_paged.attention_backends": "hf_paged.attention.backends",
    "hf_paged.kv_pool": "hf_paged.executor.kv_pool",
    "hf_paged.cache": "hf_paged.hf.cache",
    "hf_paged.cli_checks": "hf_paged.cli.checks",
    "hf_paged.cli_engine": "hf_paged.cli.engine",
    "hf_paged.cli_replicas": "hf_paged.cli.replicas",
    "hf_paged.cpu.native": "hf_paged.kernels.cpu.native",
    "hf_paged.cpu.attention": "hf_paged.kernels.cpu.attention",
    "hf_paged.cpu.native_gemm": "hf_paged.kernels.cpu.native_gemm",
    "hf_paged.cpu.fused_ops": "hf_paged.kernels.cpu.fused_ops",
    "hf_paged.cpu.probes": "hf_paged.kernels.cpu.probes",
    "hf_paged.cpu.isa": "hf_paged.kernels.cpu.isa",
    "hf_paged.cpu.tuning_store": "hf_paged.kernels.cpu.tuning_store",
    "hf_paged.cpu.fused_layers": "hf_paged.model.layers.fused_decoder",
    "hf_paged.cpu.packed_model": "hf_paged.model.layers.packed",
    "hf_paged.cpu.packed_linear": "hf_paged.kernels.cpu.packed_linear",
    "hf_paged.cpu.quant_formats": "hf_paged.kernels.cpu.quant_formats",
    "hf_paged.cpu.quant_linear": "hf_paged.model.layers.quant_linear",
    "hf_paged.cpu.quant_modes": "hf_paged.model.layers.quant_modes",
    "hf_paged.cpu.quantize_model": "hf_paged.model.layers.quantize",
    "hf_paged.cpu.native_program": "hf_paged.executor.native_program",
    "hf_paged.cpu.program_fit": "hf_paged.executor.program_fit",
    "hf_paged.cpu.quant_program": "hf_paged.executor.quant_program",
    "hf_paged.kernels.triton_attention": "hf_paged.kernels.triton.attention",
    "hf_paged.kernels.triton_common": "hf_paged.kernels.triton.common",
    "hf_paged.kernels.triton_decode": "hf_paged.kernels.triton.decode",
    "hf_paged.kernels.triton_store": "hf_paged.kernels.triton.store",
    "hf_paged.kernels.triton_varlen": "hf_paged.kernels.triton.varlen",
}


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the importer's line: past this module and ``importlib``
    (``warnings`` itself skips the import system's ``_bootstrap`` frames without counting them)."""
    frame, level = sys._getframe(2), 2  # the caller of create_module
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back
            continue
        if "importlib" not in name:
            return level
        frame, level = frame.f_back, level + 1
    return 2


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self.module: ModuleType | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{self.old} moved to {self.new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=_caller_stacklevel())
        self.module = importlib.import_module(self.new)
        self._attrs = {k: self.module.__dict__.get(k) for k in ("__spec__", "__loader__")}
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the alias's spec on the module: give it back its own
        for key, value in self._attrs.items():
            setattr(module, key, value)


class MovedFinder(importlib.abc.MetaPathFinder):
    """Resolves each old dotted path of :data:`MOVED` to the module at its new path."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(fullname, new))


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once: an old path always means the moved module, even where a
    stale copy of the old file is still on the path (an editable install of an older checkout)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
