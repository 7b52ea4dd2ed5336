"""The native decode program (cpu/native_program.py): recorded kernel calls replayed per decode step."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.kernels.cpu import fused_ops, packed_linear
from hf_paged.kernels.cpu.native_gemm import NATIVE_GEMM
from tests.helpers import make_model, make_prompts, stock_greedy

# the program runs on the native GEMM: force that packing (a tiny model's start-up timing may pick F.linear)
NATIVE = dict(prepack_weights="native")


def _bf16_gemm() -> bool:
    lib = NATIVE_GEMM.load()
    return lib is not None and bool(lib.hfp_gemm_bf16_ok())


def _stock_checker(model, prompts, max_tokens: int = 8):
    """``check(engine)``: greedy generation of ``prompts`` through ``engine`` equals stock ``generate``."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    def check(engine):
        for prompt, out in zip(prompts, engine.generate(prompts, params, use_tqdm=False)):
            assert list(out.outputs[0].token_ids) == stock_greedy(model, prompt, max_tokens)

    return check


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])  # qwen2: q/k/v biases; mistral: window 48
def test_program_matches_stock_generate_and_the_eager_engine(arch):
    model = make_model(arch, seed=11)
    # three slots for five prompts: requests join and leave while others decode; lengths around the window
    prompts = make_prompts(5, lengths=[1, 16, 47, 49, 70], seed=3)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    with PagedGenerator(model, num_blocks=96, max_num_seqs=3, **NATIVE) as engine:
        program = engine.executor.runner.fast
        assert program is not None, "the program was not made for a fused model with native packs"
        outs = _tokens(engine.generate(prompts, params, use_tqdm=False))
        assert program.num_runs > 0
    with PagedGenerator(model, num_blocks=96, max_num_seqs=3, enforce_eager=True, **NATIVE) as eager:
        assert eager.executor.runner.fast is None
        assert _tokens(eager.generate(prompts, params, use_tqdm=False)) == outs
    for prompt, tokens in zip(prompts, outs):
        assert tokens == stock_greedy(model, prompt, 20)


@pytest.mark.parametrize("dtype,kind", [
    (torch.float32, "native"), (torch.bfloat16, "native"), (torch.float32, "onednn"), (torch.bfloat16, "onednn"),
    (torch.float32, "mkl"), (torch.bfloat16, "upcast"),
])
def test_program_logits_are_the_eager_logits_bitwise(dtype, kind):
    """Every packing: native packs are C calls in the program, the others their own linear into its buffers."""
    if not packed_linear.available(kind, dtype):
        pytest.skip(f"{kind} packing of {dtype} does not work here: {packed_linear.unavailable_reason(kind, dtype)}")
    model = make_model("qwen2", seed=12, dtype=dtype)
    prompts = make_prompts(4, lengths=[3, 20, 33, 9], seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5)
    results = []
    for eager in (False, True):
        with PagedGenerator(model, num_blocks=64, max_num_seqs=4, enforce_eager=eager, prepack_weights=kind) as engine:
            assert engine.packed.kinds[dtype] == kind
            outs = engine.generate(prompts, params, use_tqdm=False)
            assert (engine.executor.runner.fast is not None and engine.executor.runner.fast.num_runs > 0) != eager
            results.append([(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs])
    assert results[0] == results[1]


def test_program_prefills_short_prompts_sampling_their_last_rows_only():
    """Prompts of up to 64 tokens take the native attention, so their prefill runs in the program: 26 rows, 3
    of them sampled (the final norm and the LM head on those only)."""
    model = make_model("mistral", seed=19)
    prompts = make_prompts(3, lengths=[5, 9, 12], seed=10)
    with PagedGenerator(model, num_blocks=32, max_num_seqs=3, **NATIVE) as engine:
        program = engine.executor.runner.fast
        partial = []
        # the sampled rows are picked after the final norm's C pass, or by the torch norm where that is not exact
        name = "_gather_sampled" if fused_ops.rms_norm_exact(torch.float32) else "_final_norm"
        final_norm = getattr(program, name)
        setattr(program, name, lambda: partial.append(program._index is not None) or final_norm())
        program._record(program.capacity, program.logits_capacity)  # the list picks the wrapped method up
        outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert partial[0] and not any(partial[1:]) and len(partial) == program.num_runs == 6
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == stock_greedy(model, prompt, 6)


@pytest.mark.parametrize("exact", [True, False])
def test_final_norm_is_a_c_pass_only_where_it_gives_the_modules_bits(monkeypatch, exact):
    """Where the C RMSNorm gives torch's bits (probed), the final norm is one C pass over every row (the sampled
    rows gathered after it); elsewhere transformers' module runs. Either way the eager engine's logits, bitwise."""
    assert fused_ops.rms_norm_exact(torch.float32), "the RMSNorm kernel should sum in torch's order on x86 hosts"
    monkeypatch.setattr(fused_ops, "rms_norm_exact", lambda dtype, n=None: exact)
    model = make_model("llama", seed=21)
    prompts = make_prompts(3, lengths=[4, 11, 7], seed=12)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
    results = []
    for eager in (False, True):
        with PagedGenerator(model, num_blocks=32, max_num_seqs=3, enforce_eager=eager, **NATIVE) as engine:
            if not eager:
                program = engine.executor.runner.fast
                names = {getattr(fn, "__name__", "") for fn, _ in program._ops.joined}
                assert ("_gather_sampled" in names) == exact and ("_final_norm" in names) != exact
            outs = engine.generate(prompts, params, use_tqdm=False)
            results.append([(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs])
    assert results[0] == results[1]


def test_program_verifies_drafts():
    """Speculative steps (1 + k query tokens a sequence) replay too, and keep the stock tokens."""
    model = make_model("llama", seed=13)
    prompts = [p * 3 for p in make_prompts(3, lengths=[6, 9, 4], seed=6)]  # repeats: the n-gram drafts hit
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    with PagedGenerator(model, num_blocks=64, max_num_seqs=3, speculative_config=spec, **NATIVE) as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
        assert engine.executor.runner.fast.num_runs > 0
        assert engine.stats().spec_num_draft_tokens > 0
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == stock_greedy(model, prompt, 16)


def test_program_follows_changed_weights_threads_and_hooks():
    model = make_model("llama", seed=14)
    check = _stock_checker(model, make_prompts(3, lengths=[5, 18, 30], seed=7))

    threads = torch.get_num_threads()
    with PagedGenerator(model, num_blocks=64, max_num_seqs=3, **NATIVE) as engine:
        program = engine.executor.runner.fast
        check(engine)
        runs, records = program.num_runs, program.num_records
        with torch.no_grad():  # in place (a training step), and replaced objects (load a new tensor)
            model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
            model.model.layers[1].post_attention_layernorm.weight.add_(0.25)
            model.model.layers[1].mlp.down_proj.weight = torch.nn.Parameter(model.model.layers[1].mlp.down_proj.weight * 0.5)
            model.model.norm.weight = torch.nn.Parameter(model.model.norm.weight.clone() + 0.5)
        check(engine)
        assert program.num_runs > runs and program.num_records > records
        torch.set_num_threads(1)
        try:
            records = program.num_records
            check(engine)
            assert program.num_records == records + 1
        finally:
            torch.set_num_threads(threads)
        seen = []
        handle = model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda *a: seen.append(1))
        try:
            runs = program.num_runs
            check(engine)
            assert seen and program.num_runs == runs, "a hooked module was skipped by the program"
            assert "forward hooks" in program.why_not
        finally:
            handle.remove()
        check(engine)
        assert program.num_runs > runs and program.why_not == ""


def test_program_grows_its_buffers_and_writes_only_the_step_slots():
    model = make_model("llama", seed=15)
    prompts = make_prompts(20, lengths=[(7 * i) % 23 + 1 for i in range(20)], seed=8)
    with PagedGenerator(model, num_blocks=128, max_num_seqs=24, enable_prefix_caching=False, **NATIVE) as engine:
        program = engine.executor.runner.fast
        engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert program.capacity == 16 and program.num_records == 1
        for k, v in engine.pool.kv_caches:  # slots the next requests are not given must stay NaN
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
        assert program.capacity >= 20 and program.num_records >= 2
        for prompt, o in zip(prompts, outs):
            assert list(o.outputs[0].token_ids) == stock_greedy(model, prompt, 6)
        # each sequence wrote its prompt and every sampled token but the last, once
        written = sum(len(p) + 5 for p in prompts)
        for k, v in engine.pool.kv_caches:
            assert int((~k.isnan().flatten(2).all(-1)).sum()) == written
            assert int((~v.isnan().flatten(2).all(-1)).sum()) == written
        # re-records for changed weights keep the buffer sizes (they grow for larger steps only)
        capacity, logits_capacity, records = program.capacity, program.logits_capacity, program.num_records
        for i in range(4):
            with torch.no_grad():
                model.model.layers[0].input_layernorm.weight.mul_(1.0)
            engine.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
        assert program.num_records == records + 4
        assert (program.capacity, program.logits_capacity) == (capacity, logits_capacity)


def test_decode_runner_native_refuses_models_it_cannot_run():
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )).eval()
    with pytest.raises(ValueError, match="decode_runner='native' cannot run this model: Gemma2ForCausalLM is not one of"):
        PagedGenerator(gemma, num_blocks=16, decode_runner="native")
    assert gemma.config._attn_implementation != "hf_paged"  # the failed start gave everything back
    model = make_model("llama", seed=16)
    with pytest.raises(ValueError, match="needs the fused layers"):
        PagedGenerator(model, num_blocks=16, decode_runner="native", fuse_layers=False)
    with PagedGenerator(gemma, num_blocks=16) as engine:  # auto: the eager path, no error
        assert engine.executor.runner.fast is None
    with PagedGenerator(model, num_blocks=16, decode_runner="native", enforce_eager=True, **NATIVE) as engine:
        assert engine.executor.runner.fast is None
    with pytest.raises(ValueError, match="decode_runner must be one of"):
        PagedGenerator(model, num_blocks=16, decode_runner="replay")


def test_auto_is_the_program_on_cpu_and_graphs_on_cuda():
    from hf_paged.executor.decode_buckets import resolve_mode

    assert resolve_mode("auto", False, torch.device("cpu")) == "native"
    assert resolve_mode("auto", False, torch.device("cuda")) == "cuda_graphs"
    assert resolve_mode("auto", True, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="decode_runner='native' runs CPU kernels, this model is on cuda"):
        resolve_mode("native", False, torch.device("cuda"))


def test_program_survives_a_failed_recording_and_notices_swapped_storage_and_modules(monkeypatch):
    model = make_model("llama", seed=17)
    check = _stock_checker(model, make_prompts(3, lengths=[4, 11, 25], seed=9))

    with PagedGenerator(model, num_blocks=64, max_num_seqs=3, **NATIVE) as engine:
        program = engine.executor.runner.fast
        check(engine)
        # an allocation failing halfway through a re-record: the old call list must not be replayed
        packing = engine.packed

        def no_memory(module):
            raise MemoryError("simulated")

        monkeypatch.setattr(packing, "current_pack", no_memory)
        with torch.no_grad():
            model.model.layers[0].input_layernorm.weight.add_(0.125)
        runs = program.num_runs
        check(engine)
        assert program.num_runs == runs and "recording failed: MemoryError" in program.why_not
        assert program._ops is None and program.capacity == 0
        monkeypatch.undo()
        program._retry_in = 0
        check(engine)
        assert program.num_runs > runs
        # new storage under the same Parameter object and version (``param.data = t``), in every norm and a linear
        with torch.no_grad():
            for layer in model.model.layers:
                layer.input_layernorm.weight.data = layer.input_layernorm.weight.clone() * 3
            model.model.layers[1].mlp.down_proj.weight.data = model.model.layers[1].mlp.down_proj.weight.clone() * 0.5
            model.model.layers[0].self_attn.q_proj.weight.data = model.model.layers[0].self_attn.q_proj.weight.clone() * 2
        records = program.num_records
        check(engine)
        assert program.num_records > records
        # a replaced module (not packed by the engine): the program steps aside, the new module serves
        old = model.lm_head
        new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
        with torch.no_grad():
            new.weight.copy_(old.weight * 1.5)
        model.lm_head = new
        try:
            runs = program.num_runs
            check(engine)
            assert program.num_runs == runs and "not packed" in program.why_not
        finally:
            model.lm_head = old


def test_close_lets_the_kv_pool_go():
    import gc
    import weakref

    model = make_model("llama", seed=18)
    engine = PagedGenerator(model, num_blocks=32, **NATIVE)
    engine.generate(make_prompts(2, lengths=[3, 7], seed=1), SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert engine.executor.runner.fast.num_runs > 0
    pool = weakref.ref(engine.pool.kv_caches[0][0])
    buffer = weakref.ref(engine.executor.runner.fast._x)
    engine.close()
    gc.collect()
    assert engine.executor.runner.fast is None and pool() is None and buffer() is None



def test_bound_c_calls_convert_their_arguments_once_and_read_the_cells_at_each_call():
    """program_ops.c_call: a C function's Python ints and floats become ctypes values once, the step's cells stay
    cells (read when called), other ops pass as they are; the twin keeps the address, the name and the restype."""
    import ctypes

    from hf_paged.executor.program_ops import c_call

    lib = fused_ops.LIBRARY.load()
    x, w = torch.randn(4, 40), torch.rand(40) + 0.5
    out = torch.zeros(4, 40)
    rows = ctypes.c_int(1)
    args = (x.data_ptr(), 40, None, 0, None, 0, w.data_ptr(), out.data_ptr(), 40, rows, 40, 1e-5, 0,
            fused_ops.torch_sum_lanes(), 1)
    python_op = (lambda: None, ())
    (fn, converted), same = c_call(lib.hfp_rms_norm, args), c_call(*python_op)
    assert same[0] is python_op[0] and fn.__name__ == "hfp_rms_norm" and fn.argtypes is None and fn.restype is None
    assert converted[9] is rows and isinstance(converted[11], ctypes.c_float) and converted[2].value is None
    want = fused_ops.rms_norm(x, w, 1e-5)[0]
    assert fn(*converted) is None and torch.equal(out[:1], want[:1]) and not out[1:].any()
    rows.value = 3  # the next step's row count: the same bound call reads it
    fn(*converted)
    assert torch.equal(out[:3], want[:3]) and not out[3:].any()


def test_recorded_reads_notice_every_kind_of_change():
    """The bulk checks of what a recording read: a replaced object, a tensor's new version or storage, a changed
    setting, a LoRA slot other than the allowed one (None and the allowed slot both pass), a packed group whose
    member changed or whose pack was replaced."""
    from types import SimpleNamespace

    from hf_paged.executor.program_record import seen as _seen
    from hf_paged.executor.program_reads import RecordedReads

    sub, w = torch.nn.Linear(2, 2), torch.nn.Parameter(torch.randn(3))
    modules, params = {"sub": sub, "bias": None}, {"weight": w}
    norm = SimpleNamespace(variance_epsilon=1e-5)
    allowed = object()
    layer = SimpleNamespace(lora=None)

    member = torch.nn.Linear(2, 2)
    group = SimpleNamespace(pack=object())  # a packed group: the pack the calls read

    def reads():
        seen = [_seen(modules, "sub"), _seen(modules, "bias"), _seen(params, "weight"),
                _seen(member._parameters, "weight"), _seen(member._parameters, "bias")]  # the group's member
        return RecordedReads(seen, [(norm, "variance_epsilon", 1e-5)], [(layer, allowed)], [(group, group.pack)])

    r = reads()
    assert r.valid()
    layer.lora = allowed
    assert r.valid(), "the allowed slot"
    layer.lora = None
    assert r.valid()
    layer.lora = object()
    assert not r.valid(), "another slot"
    layer.lora = None
    changes = [
        lambda: modules.__setitem__("sub", torch.nn.Linear(2, 2)),
        lambda: modules.__setitem__("bias", torch.zeros(2)),
        lambda: w.detach().mul_(2),  # in place (detach shares the version counter): a new version
        lambda: setattr(w, "data", torch.randn(3)),  # new storage, same object and version
        lambda: setattr(norm, "variance_epsilon", 1e-6),
        lambda: setattr(group, "pack", object()),
    ]
    for i, change in enumerate(changes):
        r = reads()
        assert r.valid()
        change()
        assert not r.valid(), f"change {i} went unnoticed"
        modules.update(sub=sub, bias=None)
        norm.variance_epsilon = 1e-5
    for change in (lambda: member.weight.mul_(2), lambda: setattr(member, "bias", torch.nn.Parameter(torch.ones(2)))):
        r = reads()
        with torch.no_grad():
            change()
        assert not r.valid(), "a changed group member: the recording is stale (recording again re-packs the group)"
    assert reads().valid()
