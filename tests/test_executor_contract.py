"""The Executor contract: code outside hf_paged/executor/ uses only the names ``Executor.CONTRACT`` declares, and
they give what they say."""

import ast
import dataclasses
import pathlib

import pytest
import torch

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.config import EngineConfig
from hf_paged.executor import Executor, ExecutorSetup, UniProcExecutor, make_executor
from hf_paged.executor.kv_pool import KVPool
from hf_paged.spec_decode.config import SpeculativeConfig
from hf_paged.spec_decode.speculator import spec_key
from tests.helpers import make_model, make_prompts

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNNER_NAMES = {"runner", "model_runner"}  # what the executor is built on: never read from outside


def _is_executor(node: ast.AST, aliases: set[str]) -> bool:
    """``executor``, ``x.executor``, ``getattr(x, "executor"...)``, or a name bound to one of those."""
    if isinstance(node, ast.Name):
        return node.id == "executor" or node.id in aliases
    if isinstance(node, ast.Attribute):
        return node.attr == "executor"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "executor")


def contract_breaches(source: str, where: str) -> list[str]:
    """``where:line: what`` for each use of an executor outside its contract in ``source``."""
    tree = ast.parse(source)
    aliases: set[str] = set()
    for node in ast.walk(tree):  # names bound to an executor (ex = engine.executor)
        if isinstance(node, ast.Assign) and _is_executor(node.value, aliases):
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and _is_executor(node.value, aliases):
            name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) >= 2 and _is_executor(node.args[0], aliases) and isinstance(node.args[1], ast.Constant)):
            name = node.args[1].value
        if name is not None and name not in Executor.CONTRACT:
            found.append(f"{where}:{node.lineno}: executor.{name} is not in Executor.CONTRACT")
        elif isinstance(node, ast.Attribute) and node.attr in RUNNER_NAMES:
            found.append(f"{where}:{node.lineno}: .{node.attr} reaches past the executor to its model runner")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in RUNNER_NAMES:
            found.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr} uses a model runner")
    return found


def test_code_outside_the_executor_package_keeps_to_the_contract():
    found = []
    for path in sorted((ROOT / "hf_paged").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith("hf_paged/executor/"):
            found += contract_breaches(path.read_text(), rel)
    assert not found, "use Executor's contract (hf_paged/executor/executor.py):\n" + "\n".join(found)


@pytest.mark.parametrize("source,breach", [
    ("engine.executor.pool", "executor.pool is not"),
    ("self.executor.runner.fast", "executor.runner is not"),
    ("getattr(engine, 'executor', engine).runner", "executor.runner is not"),
    ("ex = self.executor\nex.packed", "executor.packed is not"),
    ("getattr(engine.executor, 'backend')", "executor.backend is not"),
    ("self.runner.prepare_batch(batch)", ".runner reaches past"),
    ("def f(runner):\n    return runner.pool.kv_caches", "runner.pool uses a model runner"),
])
def test_the_scan_finds_each_way_of_reaching_past(source, breach):
    found = contract_breaches(source, "x.py")
    assert len(found) >= 1 and breach in found[0] and found[0].startswith("x.py:"), found


def test_the_scan_leaves_contract_names_and_other_executors_alone():
    source = ("engine.executor.describe().pool\nself.executor.execute_model(out)\nself._executor.submit(fn)\n"
              "getattr(e, 'executor', None).failure\npool.executor_count\n")
    assert contract_breaches(source, "x.py") == []


def test_every_executor_implements_the_contract():
    from hf_paged.executor.multiproc import TensorParallelExecutor

    for cls in (UniProcExecutor, TensorParallelExecutor):
        assert not cls.__abstractmethods__, cls
    declared = set(vars(Executor)) | set(Executor.__annotations__)
    assert Executor.CONTRACT <= declared, Executor.CONTRACT - declared


def test_the_contract_gives_what_it_says():
    model = make_model("llama", seed=3)
    with PagedGenerator(model, block_size=4, num_blocks=64, max_num_seqs=4, swap_space=2**20) as engine:
        ex = engine.executor
        setup = ex.describe()
        assert isinstance(setup, ExecutorSetup) and ex.model is model is engine.model
        assert isinstance(setup.pool, KVPool) and setup.pool.num_blocks == ex.num_blocks == 64
        assert setup.pool.block_size == 4 and ex.num_host_blocks == setup.pool.num_host_blocks > 0
        assert ex.max_model_len == engine.max_model_len and setup.backend in ("cpu", "torch", "triton")
        assert (engine.pool, engine.backend, engine.packed, engine.fused) == (setup.pool, setup.backend, setup.packed,
                                                                             setup.fused)
        assert ex.failure is None and ex.check_health() is None and ex.comm_seconds == 0.0
        with pytest.raises(dataclasses.FrozenInstanceError):
            setup.backend = "torch"
        spec = SpeculativeConfig(method="ngram", prompt_lookup_min=2)
        assert not ex.has_proposer(spec_key(spec))
        ex.add_proposer(spec_key(spec), spec)
        assert ex.has_proposer(spec_key(spec)) and not ex.watches_weights  # no decode buckets on the CPU
    after = ex.describe()
    assert (after.packed, after.fused, after.quantized) == (None, None, None)  # close() gave them back


def test_execute_forward_runs_the_steps_forward_without_sampling():
    """What a tensor-parallel worker runs: the same block moves and forward as execute_model, so a second
    executor fed the same scheduler outputs holds the same KV."""
    model = make_model("llama", seed=3)
    kw = dict(block_size=4, num_blocks=64, max_num_seqs=4)
    sent = []
    with PagedGenerator(model, **kw) as engine:
        execute = engine.executor.execute_model
        engine.executor.execute_model = lambda out: sent.append(out) or execute(out)
        engine.generate(make_prompts(2, [9, 6], seed=2), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
        second = UniProcExecutor(model, EngineConfig.from_kwargs(**kw))
        try:
            assert all(second.execute_forward(out) is None for out in sent)
            tables: dict[int, list[int]] = {}
            slots = []  # every slot a step wrote (the rest of a block is never written: garbage in both pools)
            for out in sent:
                for item in out.scheduled:
                    table = tables.setdefault(item.seq_id, [])
                    table[item.block_ids_from:] = item.new_block_ids
                    slots += [table[p // 4] * 4 + p % 4 for p in range(item.start, item.start + len(item.token_ids))]
            assert len(slots) == 9 + 6 + 2 * 3  # the prompts, then 3 decode steps each
            for (k1, v1), (k2, v2) in zip(engine.executor.describe().pool.kv_caches, second.describe().pool.kv_caches):
                torch.testing.assert_close(k2.flatten(0, 1)[slots], k1.flatten(0, 1)[slots])
                torch.testing.assert_close(v2.flatten(0, 1)[slots], v1.flatten(0, 1)[slots])
        finally:
            second.close()


def test_make_executor_lives_in_the_package():
    import hf_paged.executor
    from hf_paged.executor import multiproc

    # the tensor-parallel module imports the factory no more (it was a circle): the package's name is the one
    assert hf_paged.executor.make_executor is make_executor and not hasattr(multiproc, "make_executor")
    with pytest.raises(TypeError, match="a model path or source needs tensor_parallel_size > 1"):
        make_executor("some/folder", EngineConfig.from_kwargs())


def test_bench_instrumentation_puts_the_runner_back():
    from hf_paged.bench.host import measure
    from hf_paged.executor.model_runner import ModelRunner

    before = {name: vars(ModelRunner)[name] for name in ("compute_logits", "prepare", "execute")}
    measure(num_seqs=2, context=32, steps=1)
    assert {name: vars(ModelRunner)[name] for name in before} == before
