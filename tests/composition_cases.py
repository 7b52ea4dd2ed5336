"""The composition matrix's machinery (tests/test_composition.py holds the outcomes and asserts them): every
engine feature as its settings plus a check that it really acted, the workloads, and a runner that builds each
engine once and caches what its workloads gave.

A cell (a, b) runs one engine with both features' settings on the workload of its request-level features. Its
reference is the same workload on an engine with only the features that change the numbers (int8 / int4
weights, the int8 KV cache): the plain engine if neither does. ``n=2`` is compared with its parts: sample ``i``
of a seeded ``n=2`` request must be the ``n=1`` request with ``seed + i``.
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hf_paged import BeamSearchParams, PagedGenerator, SamplingParams

NEW = 8  # tokens per request
SEED = 7
TIGHT_BLOCKS = 9  # two 30-token prompts fit (with a draft model's 2 lookahead slots); their decodes preempt
REGEX = r"[a-z]{3,}( [a-z]{2,})*"  # open-ended: every constrained request runs to max_tokens
# The tokens the model can emit: letters and a few space-letters, so a regex over [a-z ] still has choices.
LIVE = [*"abcdefghijklmnopqrstuvwxyz", *("\u0120" + c for c in "aest")]  # \u0120: the BPE's space

# The plain engine: eager steps, no prefix caching, unpacked weights (the packing is otherwise chosen by timing
# at start) and unpaced prefill chunks (paced ones follow measured step times).
BASE = dict(block_size=8, num_blocks=64, max_num_seqs=8, max_itl_ratio=None, enable_prefix_caching=False,
            prepack_weights=False, enforce_eager=True)


def make_model_and_prompts(tokenizer) -> tuple[torch.nn.Module, list[list[int]]]:
    """A tiny random Llama over ``tokenizer``'s vocabulary whose LM head emits only the 30 :data:`LIVE` tokens
    (its other rows are zero: logit 0, below the best live one), and three prompts that are permutations of
    them sharing their first 16 tokens (two blocks). Every token the model emits is then in its prompt, so
    n-gram lookups always find a match and draft (a random model rarely repeats itself otherwise)."""
    from tests.serving_helpers import tiny_chat_model

    model = copy.deepcopy(tiny_chat_model(tokenizer))  # a copy: the cached model is shared with other tests
    live = torch.tensor(tokenizer.convert_tokens_to_ids(LIVE))
    with torch.no_grad():
        keep = model.lm_head.weight[live].clone()
        model.lm_head.weight.zero_()
        model.lm_head.weight[live] = keep
    g = torch.Generator().manual_seed(0)
    order = live[torch.randperm(len(live), generator=g)].tolist()
    shared, rest = order[:16], order[16:]
    prompts = [shared + [rest[i] for i in torch.randperm(len(rest), generator=g).tolist()] for _ in range(3)]
    return model, prompts


# -- features ------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What one measured workload gave, with the engine's counters around it."""

    engine: PagedGenerator
    outputs: list  # per prompt, the token ids of each sample or beam
    texts: list
    before: object  # EngineStats
    after: object
    fast_before: int = 0


@dataclass(frozen=True)
class Feature:
    """One feature: its engine settings (``engine``) or a request kind (``request``), whether it changes the
    numbers (``math``: its reference keeps it), what a refusal must name (``names``, a regex), and ``acted``: why
    a run shows it did not take effect ("" when it did)."""

    title: str
    names: str
    engine: dict = field(default_factory=dict)
    request: bool = False
    math: bool = False
    acted: Callable[[Run], str] = lambda run: ""


def _fast_runs(engine) -> int:
    fast = engine.executor.runner.fast
    return getattr(fast, "num_runs", 0) + getattr(fast, "num_replays", 0)


def _tp(run: Run) -> str:
    return "" if type(run.engine.executor).__name__ == "TensorParallelExecutor" else "one process"


def _quantized(fmt: str):
    def check(run: Run) -> str:
        fmts = {getattr(m, "fmt", None) for m in run.engine.model.modules() if type(m).__name__ == "QuantLinear"}
        return "" if fmt in fmts else f"no {fmt} linear in the model (found {sorted(map(str, fmts))})"
    return check


def _kv8(run: Run) -> str:
    return "" if run.engine.pool.cache_dtype == torch.int8 else f"the pool holds {run.engine.pool.cache_dtype}"


def _drafted(run: Run) -> str:
    return "" if run.after.spec_num_draft_tokens > run.before.spec_num_draft_tokens else "no draft token was verified"


def _preempted(mode: str):
    def check(run: Run) -> str:
        got = run.after.num_preemptions.get(mode, 0) - run.before.num_preemptions.get(mode, 0)
        return "" if got > 0 else f"no {mode} preemption (all: {run.after.num_preemptions})"
    return check


def _fast_runner(kind: str):
    def check(run: Run) -> str:
        fast = run.engine.executor.runner.fast
        if type(fast).__name__ != kind:
            return f"decode steps run on {type(fast).__name__}, not {kind}"
        return "" if _fast_runs(run.engine) > run.fast_before else f"{kind} ran no step"
    return check


def _prefix_hit(run: Run) -> str:
    return "" if run.after.prefix_cache_hits > run.before.prefix_cache_hits else "no prefix cache hit"


def _in_grammar(run: Run) -> str:
    bad = [t for texts in run.texts for t in texts if not re.fullmatch(r"[a-z ]*", t or "")]
    return f"outputs outside the grammar: {bad[:2]}" if bad else ""


def _two_each(run: Run) -> str:
    return "" if all(len(o) == 2 for o in run.outputs) else "not two sequences per prompt"


FEATURES: dict[str, Feature] = {
    "tp": Feature("tensor parallelism: `tensor_parallel_size=2` (gloo, loopback)", "tensor_parallel_size",
                  dict(tensor_parallel_size=2), acted=_tp),
    "int8": Feature('int8 weights: `quantization="int8"`', "quantization", dict(quantization="int8"), math=True,
                    acted=_quantized("int8")),
    "int4": Feature('int4 weights: `quantization="int4"`', "quantization", dict(quantization="int4"), math=True,
                    acted=_quantized("q4_1")),
    "kv8": Feature('int8 KV cache: `kv_cache_dtype="int8"`', "kv_cache_dtype", dict(kv_cache_dtype="int8"),
                   math=True, acted=_kv8),
    "ngram": Feature('n-gram speculation: `speculative_config={"method": "ngram"}`', "speculative|ngram",
                     dict(speculative_config=dict(method="ngram", num_speculative_tokens=3)), acted=_drafted),
    "self": Feature('self-drafting: `speculative_config={"method": "draft_model", "model": "self:1"}`',
                    "self:N|self:1", acted=_drafted,
                    engine=dict(speculative_config=dict(method="draft_model", model="self:1",
                                                        num_speculative_tokens=2))),
    "structured": Feature("structured output: a regex in `SamplingParams(structured_outputs=...)` (or "
                          "`BeamSearchParams`)", "structured", request=True, acted=_in_grammar),
    "n2": Feature("`n=2` samples (seeded, `temperature=0.8`, `top_k=8`)", r"\bn\b|samples", request=True,
                  acted=_two_each),
    "beam": Feature("beam search: `engine.beam_search(..., BeamSearchParams(beam_width=2))`", "beam", request=True,
                    acted=_two_each),
    "swap": Feature('preemption by swap: `preemption_mode="swap"`, a 9-block pool', "preemption|swap",
                    dict(preemption_mode="swap", swap_space=1 << 22, num_blocks=TIGHT_BLOCKS),
                    acted=_preempted("swap")),
    "recompute": Feature('preemption by recompute: `preemption_mode="recompute"`, a 9-block pool',
                         "preemption|recompute", dict(preemption_mode="recompute", num_blocks=TIGHT_BLOCKS),
                         acted=_preempted("recompute")),
    "static": Feature('decode buckets: `decode_runner="static"`', "decode_runner",
                      dict(enforce_eager=False, decode_runner="static"), acted=_fast_runner("DecodeBuckets")),
    "native": Feature('the native decode program: `decode_runner="native", prepack_weights="native"`',
                      "decode_runner", dict(enforce_eager=False, decode_runner="native", prepack_weights="native"),
                      acted=_fast_runner("DecodeProgram")),
    "prefix": Feature("prefix caching: `enable_prefix_caching=True`, the workload run twice", "prefix",
                      dict(enable_prefix_caching=True), acted=_prefix_hit),
}
NAMES = list(FEATURES)


def engine_settings(names) -> dict:
    """The engine keywords of a set of engine features (the smallest pool wins)."""
    settings = dict(BASE)
    for name in names:
        for key, value in FEATURES[name].engine.items():
            settings[key] = min(settings[key], value) if key == "num_blocks" else value
    return settings


# -- workloads ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """The requests of a cell: ``kinds`` (its request-level features), ``split`` (a seeded ``n=2`` as its two
    ``n=1`` requests: the reference form) and ``greedy_n`` (``n=2`` greedy: with speculation, rejection sampling
    draws differently from plain sampling, so seeded samples are not comparable token for token)."""

    kinds: frozenset = frozenset()
    split: bool = False
    greedy_n: bool = False


def _params(kinds, **kw) -> SamplingParams:
    extra = {"structured_outputs": {"regex": REGEX}} if "structured" in kinds else {"ignore_eos": True}
    return SamplingParams(max_tokens=NEW, **extra, **kw)


def run_workload(engine: PagedGenerator, prompts, work: Workload) -> tuple[list, list]:
    """(token ids, texts): per prompt, one list per sample or beam."""
    kinds = work.kinds
    if "beam" in kinds:
        extra = {"structured_outputs": {"regex": REGEX}} if "structured" in kinds else {"ignore_eos": True}
        params = BeamSearchParams(beam_width=2, num_return_sequences=2, max_tokens=NEW, **extra)
        outs = engine.beam_search(prompts, params)
        return [[s.token_ids for s in o.sequences] for o in outs], [[s.text for s in o.sequences] for o in outs]
    sampled = "n2" in kinds and not work.greedy_n
    if sampled and work.split:
        parts = [engine.generate(prompts, _params(kinds, temperature=0.8, top_k=8, seed=SEED + i), use_tqdm=False)
                 for i in range(2)]
        samples = [[part[k].outputs[0] for part in parts] for k in range(len(prompts))]
    elif sampled:
        outs = engine.generate(prompts, _params(kinds, temperature=0.8, top_k=8, seed=SEED, n=2), use_tqdm=False)
        samples = [o.outputs for o in outs]
    else:
        n = 2 if "n2" in kinds and not work.split else 1
        outs = engine.generate(prompts, _params(kinds, temperature=0.0, n=n), use_tqdm=False)
        samples = [list(o.outputs) * (2 if "n2" in kinds and work.split else 1) for o in outs]
    errors = [c.error for s in samples for c in s if c.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"a request failed: {errors[0]}")
    return [[c.token_ids for c in s] for s in samples], [[c.text for c in s] for s in samples]


def plan(a: str, b: str) -> tuple[tuple[str, ...], Workload]:
    """The engine features and the workload of cell (a, b); a == b: the feature alone."""
    names = {a, b}
    engine = tuple(n for n in NAMES if n in names and not FEATURES[n].request)
    kinds = frozenset(n for n in names if FEATURES[n].request)
    return engine, Workload(kinds, greedy_n="n2" in kinds and any(n in ("ngram", "self") for n in engine))


def reference_plan(engine: tuple[str, ...], work: Workload) -> tuple[tuple[str, ...], Workload]:
    """The same workload (``n=2`` split in its parts) on the engine of the features that change the numbers."""
    return tuple(n for n in engine if FEATURES[n].math), Workload(work.kinds, split=True, greedy_n=work.greedy_n)


# -- running -------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    outputs: list | None = None
    texts: list | None = None
    idle: dict = field(default_factory=dict)  # feature -> why the run shows it did not act
    error: BaseException | None = None
    stage: str = ""  # where the error came: "start" (PagedGenerator(...)), "request" (intake) or "run"


class Runner:
    """Builds each engine the matrix needs once, runs all of that engine's workloads on it, then closes it.

    Args:
        model, tokenizer, prompts: What every engine serves.
        plans: ``(engine features, workload)`` pairs the cells will ask for.
    """

    def __init__(self, model, tokenizer, prompts, plans) -> None:
        self.model, self.tokenizer, self.prompts = model, tokenizer, prompts
        self.needed: dict[tuple[str, ...], set[Workload]] = {}
        for engine, work in plans:
            self.needed.setdefault(engine, set()).add(work)
        self.done: dict[tuple, Outcome] = {}
        self.seconds: dict[tuple[str, ...], float] = {}  # each engine's start, workloads and close
        self.left_behind: dict[tuple[str, ...], list[int]] = {}  # tensor-parallel workers alive after close

    def outcome(self, engine: tuple[str, ...], work: Workload) -> Outcome:
        if (engine, work) not in self.done:
            self._run_engine(engine)
        return self.done[engine, work]

    def _run_engine(self, names: tuple[str, ...]) -> None:
        started = time.perf_counter()
        works = sorted(self.needed[names], key=lambda w: (sorted(w.kinds), w.split, w.greedy_n))
        try:
            engine = PagedGenerator(self.model, self.tokenizer, **engine_settings(names))
        except Exception as e:  # noqa: BLE001 - a refusal (or a failure) at start: every workload gets it
            self.done.update({(names, work): Outcome(error=e, stage="start") for work in works})
            return
        try:
            for work in works:
                self.done[names, work] = self._run(engine, names, work)
        finally:
            engine.close()
            workers = getattr(engine.executor, "processes", [])
            for proc in workers:
                proc.join(10)
            self.left_behind[names] = [p.pid for p in workers if p.is_alive()]
            self.seconds[names] = time.perf_counter() - started

    def _run(self, engine: PagedGenerator, names: tuple[str, ...], work: Workload) -> Outcome:
        try:
            if "prefix" in names:  # a first pass fills the prefix cache; the measured one hits it
                run_workload(engine, self.prompts, work)
            before, fast_before = engine.stats(), _fast_runs(engine)
            outputs, texts = run_workload(engine, self.prompts, work)
        except (ValueError, NotImplementedError, TypeError) as e:
            return Outcome(error=e, stage="request")
        except Exception as e:  # noqa: BLE001 - reported by the cell's test
            return Outcome(error=e, stage="run")
        run = Run(engine, outputs, texts, before, engine.stats(), fast_before)
        idle = {n: FEATURES[n].acted(run) for n in (*names, *sorted(work.kinds))}
        engine.kv_manager.check_consistency()
        if engine.kv_manager.num_used_blocks:
            idle["blocks"] = f"{engine.kv_manager.num_used_blocks} blocks still held after the run"
        return Outcome(outputs, texts, {n: why for n, why in idle.items() if why})
