"""The composition matrix: every pair of engine features, built together on a tiny model, either gives exactly the
greedy token ids of its one-feature reference or is refused by name when the engine starts (or the request is
added). No pair may quietly drop one of its features: each cell also checks that both features acted (drafts
verified, blocks preempted, the decode program replayed, prefix blocks hit, ...).

:data:`OUTCOMES` is the matrix; docs/configuration.md shows it as a table generated from it
(``python -m tests.test_composition`` prints the table; a test keeps the two equal). The machinery (features,
workloads, the runner that builds each engine once) is in ``tests/composition_cases.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.composition_cases import FEATURES, NAMES, NEW, Runner, plan, reference_plan


@dataclass(frozen=True)
class Cell:
    """One pair's documented outcome.

    kind: "=" (the reference's tokens, exactly; the reference of a feature alone is the plain engine),
    "refused" (ValueError / NotImplementedError naming both features, at start or intake), "runs" (no one-feature
    reference: both change the output; it runs and both act), "n/a" (the two cannot be asked for together) or
    "ref" (a feature alone that is itself a reference). ``idle``: features that are documented not to act in the
    pair (checked: the note must stay true).
    """

    kind: str = "="
    note: str = ""
    idle: tuple[str, ...] = ()


ONE_SETTING = "one setting: the two are values of the same key"
NO_REFERENCE = "both change the output, so there is no one-feature reference: it runs, and both act"
BEAMS_DO_NOT_SPECULATE = "beams do not speculate: the same beams, without the speed-up"
GREEDY_N = ("compared with greedy `n=2`: under speculation seeded samples follow the same distribution but take "
            "other draws (rejection sampling)")
QUANT_NATIVE = "the program runs the quantized linears; `prepack_weights` has no float linear left to pack"

OUTCOMES: dict[tuple[str, str], Cell] = {
    ("int8", "int4"): Cell("n/a", ONE_SETTING),
    ("ngram", "self"): Cell("n/a", ONE_SETTING),
    ("swap", "recompute"): Cell("n/a", ONE_SETTING),
    ("static", "native"): Cell("n/a", ONE_SETTING),
    ("n2", "beam"): Cell("n/a", "beam search has no `n`: `beam_width` is its number of sequences"),
    ("int8", "kv8"): Cell("runs", NO_REFERENCE),
    ("int4", "kv8"): Cell("runs", NO_REFERENCE),
    ("int8", "structured"): Cell("runs", NO_REFERENCE),
    ("int4", "structured"): Cell("runs", NO_REFERENCE),
    ("kv8", "structured"): Cell("runs", NO_REFERENCE),
    ("int8", "beam"): Cell("runs", NO_REFERENCE),
    ("int4", "beam"): Cell("runs", NO_REFERENCE),
    ("kv8", "beam"): Cell("runs", NO_REFERENCE),
    ("structured", "beam"): Cell("runs", NO_REFERENCE),
    ("ngram", "beam"): Cell("=", BEAMS_DO_NOT_SPECULATE, idle=("ngram",)),
    ("self", "beam"): Cell("=", BEAMS_DO_NOT_SPECULATE, idle=("self",)),
    ("ngram", "n2"): Cell("=", GREEDY_N),
    ("self", "n2"): Cell("=", GREEDY_N),
    ("int8", "native"): Cell("=", QUANT_NATIVE),
    ("int4", "native"): Cell("=", QUANT_NATIVE),
    # alone: the features that change the output are the references of the others
    **{(n, n): Cell("ref") for n in ("int8", "int4", "kv8", "structured", "beam")},
}
# the tensor-parallel cells each start a group of two processes (the worker imports torch and transformers):
# about 15 s each on 2 busy cores, so they are marked slow
SLOW = {"tp"}


def cell_of(a: str, b: str) -> Cell:
    return OUTCOMES.get((a, b), Cell())


CELLS = [(a, b) for i, a in enumerate(NAMES) for b in NAMES[i:]]
TESTED = [(a, b) for a, b in CELLS if cell_of(a, b).kind in ("=", "refused", "runs")]


@pytest.fixture(scope="module")
def runner():
    pytest.importorskip("xgrammar")
    from tests.composition_cases import make_model_and_prompts
    from tests.serving_helpers import default_tokenizer

    # One thread: a tiny model's matmuls are far below OpenMP's break-even, and on busy cores two spinning
    # threads make every step many times slower. (Spawned tensor-parallel workers get cores / 2 = 1 anyway.)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokenizer = default_tokenizer()
    model, prompts = make_model_and_prompts(tokenizer)
    plans = []
    for a, b in TESTED:
        engine, work = plan(a, b)
        plans.append((engine, work))
        if cell_of(a, b).kind == "=":
            plans.append(reference_plan(engine, work))
    yield Runner(model, tokenizer, prompts, plans)
    torch.set_num_threads(threads)


def _describe(outcome) -> str:
    return f"{type(outcome.error).__name__} at {outcome.stage}: {outcome.error}" if outcome.error else "ran"


@pytest.mark.parametrize(
    "a,b", [pytest.param(a, b, id=f"{a}-{b}", marks=[pytest.mark.slow] if SLOW & {a, b} else []) for a, b in TESTED]
)
def test_pair(runner, a, b):
    cell = cell_of(a, b)
    engine, work = plan(a, b)
    got = runner.outcome(engine, work)
    assert not runner.left_behind.get(engine), f"tensor-parallel workers left running: {runner.left_behind[engine]}"
    assert not torch.distributed.is_initialized(), "a closed tensor-parallel engine left its process group"
    if cell.kind == "refused":
        assert isinstance(got.error, (ValueError, NotImplementedError)) and got.stage in ("start", "request"), (
            f"{a} with {b} should be refused at start or intake, got: {_describe(got)}"
        )
        for name in (a, b):
            assert re.search(FEATURES[name].names, str(got.error)), f"the refusal does not name {name}: {got.error}"
        return
    assert got.error is None, f"{a} with {b}: {_describe(got)}"
    assert set(got.idle) == set(cell.idle), f"{a} with {b}: a feature did not act: {got.idle}"
    lengths = {len(ids) for sequences in got.outputs for ids in sequences}
    assert lengths == {NEW}, f"outputs of lengths {lengths}, expected {NEW} tokens each"
    if cell.kind == "=":
        ref_engine, ref_work = reference_plan(engine, work)
        assert (ref_engine, ref_work) != (engine, work), "a cell compared with itself"
        ref = runner.outcome(ref_engine, ref_work)
        assert ref.error is None and not ref.idle, f"the reference {ref_engine or 'plain'}: {_describe(ref)} {ref.idle}"
        assert got.outputs == ref.outputs


@pytest.mark.parametrize("a,b", [(a, b) for a, b in CELLS if cell_of(a, b).kind == "n/a"])
def test_exclusive_pairs_are_one_setting(a, b):
    """An "n/a" pair really cannot be asked for together: both set the same engine key, or beam search and n."""
    shared = set(FEATURES[a].engine) & set(FEATURES[b].engine) - {"num_blocks", "enforce_eager", "swap_space"}
    assert shared and all(FEATURES[a].engine[k] != FEATURES[b].engine[k] for k in shared) or {a, b} == {"n2", "beam"}


def test_every_documented_cell_is_a_pair_of_known_features():
    assert all(a in FEATURES and b in FEATURES and NAMES.index(a) <= NAMES.index(b) for a, b in OUTCOMES)
    assert all(c.kind in ("=", "refused", "runs", "n/a", "ref") for c in OUTCOMES.values())


# -- the table in docs/configuration.md ----------------------------------------------------------------
DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
BEGIN = "<!-- composition matrix: generated from tests/test_composition.py (python -m tests.test_composition) -->"
END = "<!-- end of the composition matrix -->"


def render_matrix() -> str:
    """The matrix as markdown: a legend, the table (symmetric) and its numbered notes."""
    notes: list[str] = []

    def text(cell: Cell) -> str:
        label = {"=": "=", "refused": "refused", "runs": "runs", "n/a": "n/a", "ref": "ref"}[cell.kind]
        if not cell.note:
            return label
        if cell.note not in notes:
            notes.append(cell.note)
        return f"{label} ({notes.index(cell.note) + 1})"

    lines = [BEGIN, ""]
    lines += [f"- **{name}**: {feature.title}" for name, feature in FEATURES.items()]
    lines += ["", "| | " + " | ".join(NAMES) + " |", "|---" * (len(NAMES) + 1) + "|"]
    for a in NAMES:
        row = [text(cell_of(*sorted((a, b), key=NAMES.index))) for b in NAMES]
        lines.append(f"| **{a}** | " + " | ".join(row) + " |")
    lines.append("")
    lines += [f"{i}. {note}" for i, note in enumerate(notes, 1)]
    lines += ["", END]
    return "\n".join(lines)


def test_the_documented_table_is_this_matrix():
    doc = DOC.read_text()
    assert BEGIN in doc and END in doc, f"{DOC.name} has no composition matrix block"
    block = doc[doc.index(BEGIN) : doc.index(END) + len(END)]
    assert block == render_matrix(), "docs/configuration.md's matrix differs: paste `python -m tests.test_composition`"


if __name__ == "__main__":
    print(render_matrix())
