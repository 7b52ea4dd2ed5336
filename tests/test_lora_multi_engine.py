"""Several engines with ``enable_lora`` on one model: each serves its own adapters, also stepping at once in two
threads (a server's engine loop and a user's second ``PagedGenerator``), and closing one leaves the others working.

The engines share the model's linear layer objects (one ``lora`` attribute each); both engines register their
adapter under the same ``lora_int_id`` 1, so a row given the other engine's adapter (or slot) would show.
"""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("peft")

from hf_paged import LoRARequest, PagedGenerator, SamplingParams  # noqa: E402
from hf_paged.lora.hooks import current_manager  # noqa: E402
from tests.helpers import make_model, make_prompts, stock_greedy  # noqa: E402
from tests.test_lora import ADAPTERS, make_adapter  # noqa: E402

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
SETTINGS = dict(enable_lora=True, max_loras=1, max_lora_rank=8, num_blocks=48)
NAMES = ["x", None, "x", "x"]  # per prompt: the engine's adapter or the base


@pytest.fixture(scope="module")
def two_adapters(tmp_path_factory):
    """(base, {engine: (its LoRARequest with id 1, its PeftModel)}): engine "one" serves adapter b, "two" c (both
    adapt o_proj: the same layer objects carry both engines' steps)."""
    base = make_model("llama")
    root = tmp_path_factory.mktemp("lora-multi-engine")
    out = {}
    for engine, (name, seed) in {"one": ("b", 41), "two": ("c", 42)}.items():
        peft_model = make_adapter(base, root / name, seed=seed, **ADAPTERS[name])
        out[engine] = (LoRARequest(name, 1, str(root / name)), peft_model)
    return base, out


def _refs(base, peft_model, prompts):
    return [stock_greedy(base if n is None else peft_model, p, MAX_TOKENS) for p, n in zip(prompts, NAMES)]


def _generate(engine, req, prompts):
    loras = [None if n is None else req for n in NAMES]
    return [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]


def _engine(base, runner: str):
    if runner == "eager":
        return PagedGenerator(base, enforce_eager=True, **SETTINGS)
    try:
        return PagedGenerator(base, decode_runner="native", prepack_weights="native", **SETTINGS)
    except ValueError as e:  # the native program needs kernels this CPU may lack
        pytest.skip(str(e))


def _no_hook_left(engine) -> bool:
    return all(layer.lora is None for layer in engine.executor.lora._layers.values())


def test_two_engines_on_one_model_each_serve_their_own_adapter(two_adapters):
    base, adapters = two_adapters
    prompts = make_prompts(len(NAMES), seed=51)
    refs = {e: _refs(base, model, prompts) for e, (_, model) in adapters.items()}
    assert refs["one"] != refs["two"]  # the adapters' rows differ: a row given the other's would show
    with _engine(base, "eager") as one, _engine(base, "eager") as two:
        for _ in range(2):  # taking turns in one thread
            assert _generate(one, adapters["one"][0], prompts) == refs["one"]
            assert _generate(two, adapters["two"][0], prompts) == refs["two"]
        assert [r.lora_name for r in one.list_loras()] == ["b"] and [r.lora_name for r in two.list_loras()] == ["c"]
        assert _no_hook_left(one) and _no_hook_left(two)


@pytest.mark.parametrize("runner", ["eager", "native"])
def test_two_engines_stepping_at_once_in_two_threads(two_adapters, runner):
    """Both engines' adapter steps overlap (each engine's first adapter step waits, its hooks on the layers, until
    the other's is set too): every row still gets its own engine's adapter, and one engine's step ending never
    takes the hooks off a layer the other's step still runs."""
    base, adapters = two_adapters
    prompts = make_prompts(len(NAMES), seed=52)
    refs = {e: _refs(base, model, prompts) for e, (_, model) in adapters.items()}
    with _engine(base, runner) as one, _engine(base, runner) as two:
        engines = {"one": one, "two": two}
        both_set = threading.Barrier(2, timeout=60)
        overlapped = []

        def hold_first_step(manager):
            set_step = manager.set_step

            def wrapped(*args, **kwargs):
                set_step(*args, **kwargs)
                manager.set_step = set_step  # only the first step waits
                overlapped.append(both_set.wait() is not None)

            manager.set_step = wrapped

        for engine in engines.values():
            hold_first_step(engine.executor.lora)
        results, errors = {}, []

        def serve(name):
            try:
                results[name] = [_generate(engines[name], adapters[name][0], prompts) for _ in range(2)]
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=serve, args=(name,)) for name in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert overlapped == [True, True]
        assert results == {name: [refs[name]] * 2 for name in engines}
        assert _no_hook_left(one) and _no_hook_left(two)
        if runner == "native":  # the programs served the adapter steps, the other engine's hooks set or not
            assert all(e.executor.runner.fast.num_lora_runs > 0 for e in engines.values())


def test_closing_one_engine_leaves_the_other_serving(two_adapters):
    base, adapters = two_adapters
    prompts = make_prompts(len(NAMES), seed=53)
    refs = {e: _refs(base, model, prompts) for e, (_, model) in adapters.items()}
    with _engine(base, "eager") as two:
        with _engine(base, "eager") as one:
            assert _generate(one, adapters["one"][0], prompts) == refs["one"]
            assert _generate(two, adapters["two"][0], prompts) == refs["two"]
        assert _generate(two, adapters["two"][0], prompts) == refs["two"]
        with _engine(base, "eager") as three:  # a new engine after the close: its own adapter again
            assert _generate(three, adapters["one"][0], prompts) == refs["one"]
        assert _generate(two, adapters["two"][0], prompts) == refs["two"]
        assert _no_hook_left(two)
    base_out = PagedGenerator(base, num_blocks=32).generate(prompts[:1], GREEDY, use_tqdm=False)
    assert base_out[0].outputs[0].token_ids == stock_greedy(base, prompts[0], MAX_TOKENS)


def test_a_hook_runs_only_the_slot_of_the_manager_stepping_in_this_thread(two_adapters):
    """Mid-step of engine one (its hooks on the layers, in this thread), engine two's manager steps in another
    thread through the same hook objects, as that thread's current manager; its step ending leaves engine one's
    hook on the layer, and engine one's ending takes it off."""
    base, adapters = two_adapters
    with _engine(base, "eager") as one, _engine(base, "eager") as two:
        one.add_lora(adapters["one"][0])
        two.add_lora(adapters["two"][0])
        m1, m2 = one.executor.lora, two.executor.lora
        name = next(n for n in m1._layers if n.endswith("o_proj"))  # both adapters adapt o_proj
        layer = m1._layers[name]
        assert m2._layers[name] is layer
        seen = {}
        m1.set_step([(1, 3)], torch.device("cpu"))
        try:
            hook = layer.lora
            assert hook is not None and hook is m1.hook_of(layer) is m2.hook_of(layer)
            assert current_manager() is m1

            def other():
                seen["idle"] = current_manager()
                m2.set_step([(1, 3)], torch.device("cpu"))
                try:
                    seen["two"] = (current_manager(), layer.lora)
                finally:
                    m2.clear_step()
                seen["after"] = layer.lora

            t = threading.Thread(target=other)
            t.start()
            t.join(60)
            assert current_manager() is m1
        finally:
            m1.clear_step()
        assert seen == {"idle": None, "two": (m2, hook), "after": hook}  # two's end left one's hook on
        assert layer.lora is None and current_manager() is None
        assert m1.slot_of_hook(hook) is m1.slots[name] and m2.slot_of_hook(hook) is m2.slots[name]


def test_a_plain_native_engine_keeps_its_program_while_a_lora_engines_hooks_are_set(two_adapters):
    """A plain engine's native decode program on the same model keeps serving (no re-record, no eager fallback)
    while a LoRA engine's step has its hooks on the shared layers in another thread, and its tokens stay the base
    model's: the hooks add nothing outside the LoRA engine's stepping thread."""
    base, adapters = two_adapters
    prompt = make_prompts(1, lengths=[12], seed=54)[0]
    try:
        plain = PagedGenerator(base, decode_runner="native", prepack_weights="native", num_blocks=32)
    except ValueError as e:
        pytest.skip(str(e))
    with plain, _engine(base, "eager") as lora_engine:
        lora_engine.add_lora(adapters["one"][0])
        program = plain.executor.runner.fast
        plain.generate([prompt], GREEDY, use_tqdm=False)  # recorded before the hooks go on
        manager = lora_engine.executor.lora
        outs = []
        manager.set_step([(1, len(prompt))], torch.device("cpu"))  # the LoRA engine mid-step, in this thread
        try:
            assert any(layer.lora is not None for layer in manager._layers.values())
            runs, records = program.num_runs, program.num_records
            other = threading.Thread(target=lambda: outs.extend(plain.generate([prompt], GREEDY, use_tqdm=False)))
            other.start()
            other.join(120)
        finally:
            manager.clear_step()
        assert outs[0].outputs[0].token_ids == stock_greedy(base, prompt, MAX_TOKENS)
        assert program.num_runs >= runs + MAX_TOKENS - 1 and program.num_records == records, program.why_not
