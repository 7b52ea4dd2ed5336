"""The package layout (docs/architecture.md, "Layers"): few top-level modules, no import circles, imports that
point down the layer table only, and old module paths that still work one release with a warning.

Imports are read with ``ast``, not by importing. Every ``hf_paged`` import counts, at module level and inside
functions (a lazy import is still a dependency); those under ``if TYPE_CHECKING:`` do not. The no-circles rule
is checked on module-level imports (what Python runs at import time), and a second check covers the imports
inside functions too, where the only circles allowed are the lazy edges listed in ``LAZY_CIRCLE_EDGES``.
Importing a submodule runs its packages' ``__init__`` first, so ``a -> b.c`` also counts as ``a -> b``
(except for a package of ``a`` itself, which is already being imported).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_paged"

# The layer table, top to bottom, as (layer, module prefixes): a module may import its own layer and the layers
# below it. The longest matching prefix decides a module's layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # `hf-paged serve` and `hf-paged bench serve` start the server, so the commands sit above serving
    ("commands", ("hf_paged.cli", "hf_paged.bench", "hf_paged.train")),
    ("serving", ("hf_paged.serving", "hf_paged.ui")),
    ("api", ("hf_paged", "hf_paged._moved", "hf_paged.hf")),
    ("engine", ("hf_paged.engine",)),
    ("execution", ("hf_paged.executor", "hf_paged.sample", "hf_paged.structured", "hf_paged.spec_decode")),
    # loading, the engine's layer objects (model/layers/), and hf_paged.cpu: the old paths' package (empty)
    ("model", ("hf_paged.model", "hf_paged.cpu", "hf_paged.lora")),
    # the function transformers calls in each attention layer, and the backend objects it runs
    ("attention", ("hf_paged.attention",)),
    ("kernels", ("hf_paged.kernels",)),
    # scheduling (core/, pure Python) and the plain-data public types every layer may import; the scheduler's
    # output is the plain data execution reads, so core/ sits here, beside the types it is made of
    ("data", ("hf_paged.core", "hf_paged.config", "hf_paged.sampling_params", "hf_paged.structured_params",
              "hf_paged.outputs", "hf_paged.env", "hf_paged.launch")),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}

# Imports that point up the table, each with its reason. Keep this list short: move code instead where cheap.
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {
    # EngineConfig validates each setting against the names the layer that uses it defines (backends, packing
    # kinds, quantization formats, the ISA levels, the speculative config). Moving those names into config.py
    # means editing the modules being rewritten by the owned-layers work; revisit with it.
    ("hf_paged.config", "hf_paged.kernels.ops"): "attention backend names",
    ("hf_paged.config", "hf_paged.kernels.kv_quant"): "kv_cache_dtype check",
    ("hf_paged.config", "hf_paged.kernels.cpu.isa"): "ISA level check",
    ("hf_paged.config", "hf_paged.kernels.cpu.packed_linear"): "packing kind names",
    ("hf_paged.config", "hf_paged.model.layers.quantize"): "quantization format check",
    ("hf_paged.config", "hf_paged.spec_decode.config"): "SpeculativeConfig, a plain dataclass",
    # StructuredOutputsParams checks its constraint when built; the checks are pure Python (xgrammar is loaded
    # lazily) and live with the rest of the structured-output code
    ("hf_paged.structured_params", "hf_paged.structured.validation"): "constraint checks at construction",
    # the timing store keys its file by hf_paged's version (`from hf_paged import __version__`, in a function)
    ("hf_paged.kernels.cpu.tuning_store", "hf_paged"): "__version__",
}
# Imports inside functions allowed to close a circle (lazy by design).
LAZY_CIRCLE_EDGES: dict[tuple[str, str], str] = {
    # each bench workload is loaded only when chosen; the serve workload reuses the engine timing of workloads
    ("hf_paged.bench.workloads", "hf_paged.bench.serve"): "workload table, loaded on demand",
}
MAX_TOP_LEVEL_MODULES = 12
TORCH_FREE = ("hf_paged.core", "hf_paged.sampling_params", "hf_paged.structured_params")


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


MODULES = _modules()


def _exports() -> dict[str, str]:
    """``hf_paged.__init__``'s lazy exports: ``from hf_paged import PagedGenerator`` depends on their modules."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_EXPORTS":
            return ast.literal_eval(node.value)
    return {}


EXPORTS = _exports()


def _owner(name: str) -> str:
    """The module that ``name`` (a module or ``module.attribute``) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """``(imported hf_paged module, line, at module level)`` for every hf_paged import of ``module``."""
    path, is_pkg = MODULES[module]
    out: list[tuple[str, int, bool]] = []

    def visit(body: list[ast.stmt], top: bool) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse, top)
                continue
            if isinstance(node, ast.Import):
                out.extend((_owner(a.name), node.lineno, top) for a in node.names if a.name.startswith("hf_paged"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = module if is_pkg else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                if base.split(".")[0] == "hf_paged":
                    for a in node.names:
                        full = f"{base}.{a.name}"
                        if full in MODULES:
                            out.append((full, node.lineno, top))
                        elif base == "hf_paged" and a.name in EXPORTS:
                            out.append((EXPORTS[a.name], node.lineno, top))
                        else:
                            out.append((_owner(base), node.lineno, top))
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(node, field, None)
                if isinstance(sub, list) and sub and isinstance(sub[0], (ast.stmt, ast.excepthandler)):
                    inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    visit(sub, inner)

    visit(ast.parse(path.read_text()).body, True)
    return [(target, line, top) for target, line, top in out if target != module]


IMPORTS = {m: _imports(m) for m in MODULES}


def _with_packages(module: str, target: str) -> set[str]:
    """``target`` and its packages that importing it runs (those of ``module`` itself are running already)."""
    parts = target.split(".")
    out = {target}
    for i in range(2, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg in MODULES and not module.startswith(pkg + "."):
            out.add(pkg)
    return out


def _graph(module_level_only: bool, skip: set[tuple[str, str]] = frozenset()) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, imports in IMPORTS.items():
        for target, _, top in imports:
            if (top or not module_level_only) and (m, target) not in skip:
                graph[m] |= _with_packages(m, target) - {m}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def _describe(cycle: list[str], graph: dict[str, set[str]]) -> str:
    members = set(cycle)
    lines = []
    for m in cycle:
        for target, line, top in IMPORTS[m]:
            if _with_packages(m, target) & members - {m}:
                lines.append(f"  {MODULES[m][0].relative_to(ROOT)}:{line} imports {target}"
                             f"{'' if top else ' (inside a function)'}")
    return " <-> ".join(cycle) + "\n" + "\n".join(lines)


def layer_of(module: str) -> str:
    best, layer = "", None
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, layer = prefix, name
    assert layer is not None, f"{module} is in no layer of LAYERS: add it to the table"
    return layer


def test_at_most_twelve_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules directly under hf_paged/ (at most 12): {top}"


def test_no_import_circles_at_module_level():
    graph = _graph(module_level_only=True)
    cycles = _cycles(graph)
    assert not cycles, "import circles among module-level imports:\n" + "\n".join(_describe(c, graph) for c in cycles)


def test_no_import_circles_counting_imports_inside_functions():
    graph = _graph(module_level_only=False, skip=set(LAZY_CIRCLE_EDGES))
    cycles = _cycles(graph)
    assert not cycles, ("import circles (imports inside functions included; LAZY_CIRCLE_EDGES lists the allowed "
                        "ones):\n" + "\n".join(_describe(c, graph) for c in cycles))


def test_every_module_has_a_layer():
    for m in MODULES:
        layer_of(m)


def test_imports_point_down_the_layer_table():
    bad = []
    for m, imports in sorted(IMPORTS.items()):
        for target, line, top in imports:
            src, dst = layer_of(m), layer_of(target)
            if RANK[dst] < RANK[src] and (m, target) not in UPWARD_EXCEPTIONS:
                where = "" if top else " (inside a function)"
                bad.append(f"{MODULES[m][0].relative_to(ROOT)}:{line}: {m} ({src}) imports {target} ({dst}){where}")
    assert not bad, "imports pointing up the layer table (docs/architecture.md):\n" + "\n".join(bad)


def test_upward_exceptions_are_still_needed():
    present = {(m, t) for m, imports in IMPORTS.items() for t, _, _ in imports}
    stale = [edge for edge in UPWARD_EXCEPTIONS if edge not in present]
    stale += [edge for edge in LAZY_CIRCLE_EDGES if edge not in present]
    assert not stale, f"exceptions listed for imports that no longer exist (remove them): {stale}"


def test_scheduling_and_plain_types_never_import_torch_or_transformers():
    bad = []
    for m, (path, _) in MODULES.items():
        if not m.startswith(TORCH_FREE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[0] in ("torch", "transformers")]
    assert not bad, "\n".join(bad)


# --- old paths ---------------------------------------------------------------------------------------------

def test_old_paths_give_the_same_module_with_a_warning():
    from hf_paged import _moved

    for old, new in _moved.MOVED.items():
        if new.startswith("hf_paged.kernels.triton"):
            continue  # needs triton; covered by the finder's logic like the others
        module = __import__(new, fromlist=["_"])
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}; the old path goes in the next")):
            aliased = __import__(old, fromlist=["_"])
        assert aliased is module, old
        assert module.__name__ == new and module.__spec__.name == new  # the module keeps its own identity


def test_from_old_path_import_name():
    sys.modules.pop("hf_paged.generator", None)
    with pytest.warns(DeprecationWarning, match="hf_paged.generator moved to hf_paged.engine.generator"):
        from hf_paged.generator import PagedGenerator
    from hf_paged.engine.generator import PagedGenerator as new

    assert PagedGenerator is new


def test_monkeypatching_the_old_path_patches_the_module(monkeypatch):
    import hf_paged.engine.engine_setup as new

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import hf_paged.engine_setup as old
    monkeypatch.setattr(old, "token_ids", "patched")
    assert new.token_ids == "patched"


def test_old_attention_module_names_still_resolve():
    from hf_paged.attention import AttentionMetadata
    from hf_paged.attention.function import AttentionMetadata as new

    assert AttentionMetadata is new


def _old_path_pattern() -> re.Pattern:
    """Any old dotted path (``hf_paged.generator``) or file path (``hf_paged/generator.py``), in one pattern."""
    from hf_paged import _moved

    olds = sorted(_moved.MOVED, key=len, reverse=True)
    dotted = "|".join(re.escape(o) for o in olds)
    paths = "|".join(re.escape(o.replace(".", "/")) for o in olds)
    return re.compile(rf"(?<![\w.])(?:{dotted})(?!\w)|(?<![\w/.])(?:{paths})\.py\b")


def test_nothing_of_ours_uses_an_old_path():
    """Source, tests, examples and docs use the new paths only (the aliases are for users' code)."""
    from hf_paged import _moved

    skip = {PACKAGE / "_moved.py", Path(__file__).resolve()}
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "examples").rglob("*.py"),
             *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    pattern = _old_path_pattern()
    bad = []
    for path in files:
        if path in skip:
            continue
        text = path.read_text()
        for match in pattern.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            old = match.group(0).removesuffix(".py").replace("/", ".")
            bad.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)} (now {_moved.MOVED[old]})")
        if path.suffix == ".py":  # `from hf_paged import generator`, `from hf_paged.cpu import attention`
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    for a in node.names:
                        old = f"{node.module}.{a.name}"
                        if old in _moved.MOVED:
                            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import "
                                       f"{a.name} (now {_moved.MOVED[old]})")
    assert not bad, "old module paths in our own files:\n" + "\n".join(bad)


def test_importing_our_modules_warns_nothing_about_old_paths():
    """Import hf_paged's modules in a fresh process: none of them goes through an old path."""
    skip = ("hf_paged.ui", "hf_paged.serving.ray", "hf_paged.serving.replicas", "hf_paged.cli.replicas",
            "hf_paged.bench.replicas", "hf_paged.kernels.triton", "hf_paged.cli.__main__", "hf_paged._moved")
    names = [m for m in MODULES if not m.startswith(skip)]
    code = (
        "import importlib, warnings\n"
        "warnings.filterwarnings('error', message='.*the old path goes in the next release', "
        "category=DeprecationWarning)\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as e:\n"
        "        if 'moved to' in str(e) or getattr(e, 'name', '') and e.name.startswith('hf_paged'):\n"
        "            raise\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the old path goes in the next release" not in out.stderr, out.stderr[-3000:]
