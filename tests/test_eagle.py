"""EAGLE-3 heads: loading in the published layout, drafting inside continuous batching, lossless output."""

import json
import os

import pytest
import torch

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.spec_decode.eagle import EagleHead, EagleHeadConfig, load_head, save_head
from hf_paged.spec_decode.eagle.head import causal_attend
from hf_paged.spec_decode.eagle.loading import REQUIRED, aux_layers
from hf_paged.spec_decode.eagle.proposer import EagleProposer
from tests.helpers import make_model, make_prompts, stock_greedy

LAYERS = 4  # target decoder layers: vLLM's default ids (2, L // 2, L - 3) need L >= 4
NEW = 24

# the weight names vLLM's llama_eagle3.py and SpecForge read (d2t/t2d buffers; embed_tokens optional)
PUBLISHED = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", *REQUIRED}


def target(**kw):
    return make_model("llama", num_hidden_layers=LAYERS, **kw)


def head_config(**kw) -> EagleHeadConfig:
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=512)
    return EagleHeadConfig(**{**base, **kw})


def random_head(seed=0, draft_vocab=None, own_embedding=False, **kw) -> EagleHead:
    torch.manual_seed(seed)
    cfg = head_config(draft_vocab_size=draft_vocab, **kw)
    head = EagleHead(cfg, own_embedding=own_embedding)
    for p in head.parameters():  # decisive logits, as the tiny targets have
        torch.nn.init.normal_(p, std=0.15)
    if draft_vocab is not None:  # the draft vocabulary: every other target token
        head.d2t.copy_(torch.arange(draft_vocab))
    return head


@pytest.fixture
def head_dir(tmp_path):
    folder = str(tmp_path / "head")
    save_head(random_head(), folder)
    return folder


# -- 1. loading ------------------------------------------------------------------------------------------


def test_saved_head_has_the_published_layout_and_loads_back(tmp_path):
    head = random_head(draft_vocab=100, own_embedding=True, aux_layer_ids=[1, 2, 3])
    folder = str(tmp_path / "h")
    save_head(head, folder)
    from safetensors.torch import load_file

    names = set(load_file(os.path.join(folder, "model.safetensors")))
    assert names == PUBLISHED | {"embed_tokens.weight"}
    cfg = json.load(open(os.path.join(folder, "config.json")))
    assert cfg["draft_vocab_size"] == 100 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    loaded = load_head(folder, target())
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.to_target(torch.tensor([0, 1, 99])).tolist() == [0, 2, 198]


def test_checkpoint_names_with_model_and_layers_prefixes_and_a_torch_bin_load(tmp_path):
    head = random_head()
    state = {("model.layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v
             for k, v in head.state_dict().items()}
    folder = tmp_path / "bin"
    folder.mkdir()
    torch.save(state, folder / "pytorch_model.bin")
    json.dump(head.config.to_dict(), open(folder / "config.json", "w"))
    loaded = load_head(str(folder), target())
    assert torch.equal(loaded.midlayer.self_attn.q_proj.weight, head.midlayer.self_attn.q_proj.weight)
    assert loaded.embed_tokens is None  # shares the target's


def _break(folder, config=None, drop=None, reshape=None):
    from safetensors.torch import load_file, save_file

    if config is not None:
        raw = json.load(open(os.path.join(folder, "config.json")))
        raw.update(config)
        json.dump({k: v for k, v in raw.items() if v is not None}, open(os.path.join(folder, "config.json"), "w"))
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    if drop:
        state.pop(drop)
    if reshape:
        state[reshape] = torch.zeros(3, 3)
    save_file(state, path)


@pytest.mark.parametrize("damage,match", [
    (dict(config=dict(hidden_size=None)), r"not an EAGLE head: config.json lacks integer \['hidden_size'\]"),
    (dict(drop="fc.weight"), r"not an EAGLE-3 head: its weights lack \['fc.weight'\]"),
    (dict(reshape="midlayer.hidden_norm.weight"), r"wrong shape.*midlayer.hidden_norm.weight: \(3, 3\) \(expected \(64,\)\)"),
    (dict(config=dict(target_hidden_size=32)), r"reads hidden states of size 32, the target's are 64"),
    (dict(config=dict(vocab_size=1000)), r"vocabulary of 1000 tokens, the target's has 512"),
    (dict(config=dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]})), r"layer ids \[9\] do not fit"),
    (dict(config=dict(draft_vocab_size=100)), r"wrong shape.*lm_head"),
])
def test_a_folder_that_is_no_head_or_does_not_fit_the_target_is_a_clear_error(head_dir, damage, match):
    _break(head_dir, **damage)
    with pytest.raises(ValueError, match=match) as info:
        load_head(head_dir, target())
    assert head_dir in str(info.value)


def test_no_folder_or_no_weights_or_a_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        load_head(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="has no config.json"):
        load_head(str(tmp_path))
    model_dir = str(tmp_path / "model")
    target().save_pretrained(model_dir)  # a whole model is not a head
    with pytest.raises(ValueError, match=r"not an EAGLE-3 head: its weights lack \['fc.weight'"):
        load_head(model_dir, target())


def test_default_layers_are_vllms_early_middle_late():
    assert aux_layers(head_config(), 32) == (1, 15, 28)  # vLLM ids (2, 16, 29): states entering those layers
    assert aux_layers(head_config(aux_layer_ids=[1, 2, 3]), 4) == (0, 1, 2)
    with pytest.raises(ValueError, match="a target this shallow needs"):
        aux_layers(head_config(), 2)


# -- 2. drafting inside the engine -----------------------------------------------------------------------


def run(model, prompts, spec, params=None, **engine_kw):
    engine = PagedGenerator(model, speculative_config=spec, **engine_kw)
    params = params or SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params, use_tqdm=False)
    stats = engine.stats()
    engine.kv_manager.check_consistency()
    assert engine.kv_manager.num_used_blocks == 0
    engine.close()
    return outs, stats


PROMPTS = make_prompts(5, [3, 9, 20, 33, 50], seed=7)


@pytest.mark.parametrize("engine_kw", [
    dict(block_size=4, num_blocks=400),
    dict(block_size=1, num_blocks=2000, max_num_batched_tokens=24),  # chunked prefill beside drafting
    dict(block_size=4, num_blocks=40),  # too small for all at once: preemption
    dict(block_size=16, num_blocks=200, enable_prefix_caching=True),
])
def test_greedy_output_with_an_eagle_head_equals_stock_generate(head_dir, engine_kw):
    model = target()
    want = [stock_greedy(model, p, NEW) for p in PROMPTS]
    outs, stats = run(model, PROMPTS * (2 if engine_kw.get("enable_prefix_caching") else 1),
                      dict(method="eagle3", model=head_dir, num_speculative_tokens=3), **engine_kw)
    assert [o.token_ids for o in outs] == want * (2 if engine_kw.get("enable_prefix_caching") else 1)
    assert stats.spec_num_draft_tokens > 0
    if engine_kw["num_blocks"] == 40:
        assert sum(stats.num_preemptions.values()) > 0


def test_n_samples_and_per_request_heads_beside_other_methods(head_dir):
    model = target()
    want = [stock_greedy(model, p, NEW) for p in PROMPTS]
    engine = PagedGenerator(model, block_size=4, num_blocks=400, speculative_config=dict(method="ngram"))
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, n=2)
    eagle = dict(method="eagle3", model=head_dir, num_speculative_tokens=2)
    ids = [engine.add_request(p, params, speculative_config=eagle if i % 2 == 0 else None)
           for i, p in enumerate(PROMPTS)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
    assert [done[i] for i in ids] == [[w, w] for w in want]
    assert engine.stats().spec_num_draft_tokens > 0
    engine.kv_manager.check_consistency()
    engine.close()


class Recorder:
    """Records each proposal an EAGLE proposer makes: (tokens of the sequence, its drafts)."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = EagleProposer.propose

        def propose(proposer, states, num_tokens, tables):
            drafts = original(proposer, states, num_tokens, tables)
            for state, d in zip(states, drafts):
                if d:
                    self.calls.append((state.prompt_token_ids + state.output_token_ids, d))
            return drafts

        monkeypatch.setattr(EagleProposer, "propose", propose)


def reference_drafts(model, head, tokens, k):
    """The head's greedy drafts computed plainly: one causal forward over the whole history per draft."""
    from hf_paged.train.eagle_data import target_states

    aux, _ = target_states(model, tokens, aux_layers(head.config, LAYERS))
    with torch.no_grad():
        fed = head.fc(aux)[:-1]
        ids, drafts = list(tokens[1:]), []
        for _ in range(k):
            prenorm = head(torch.tensor(ids), torch.arange(len(ids)), fed, causal_attend)
            token = int(head.to_target(head.logits(prenorm[-1:]).argmax(-1)))
            drafts.append(token)
            ids.append(token)
            fed = torch.cat([fed, prenorm[-1:]])
    return drafts


NATIVE = dict(decode_runner="native", prepack_weights="native", enforce_eager=False)  # the CPU decode program


@pytest.mark.parametrize("engine_kw", [dict(block_size=4, num_blocks=400),
                                       dict(block_size=2, num_blocks=1000, max_num_batched_tokens=16),
                                       dict(block_size=16, num_blocks=400, **NATIVE)])
def test_paged_drafts_equal_a_plain_forward_of_the_head_over_the_whole_history(monkeypatch, engine_kw):
    """The head's KV, caught up from the rows each step captured, gives the drafts a plain forward does."""
    from hf_paged.spec_decode.speculator import Speculator

    monkeypatch.setattr(Speculator, "num_drafts", lambda self, state, max_len, cost=0.0: min(
        3, state.params.max_tokens - len(state.output_token_ids) - 1))  # always draft: no idling on rejections
    model = target()
    head = random_head(seed=2, draft_vocab=200, aux_layer_ids=[1, 3, 2])
    recorder = Recorder(monkeypatch)
    served = []
    if "decode_runner" in engine_kw:  # the hidden states come from the native program's recorded copies
        from hf_paged.executor.native_program import DecodeProgram

        original = DecodeProgram.run

        def run_program(self, step):
            logits = original(self, step)
            if logits is not None:
                served.append(tuple(step.hidden))
            return logits

        monkeypatch.setattr(DecodeProgram, "run", run_program)
    run(model, PROMPTS, dict(method="eagle3", model=head, num_speculative_tokens=3), **engine_kw)
    if "decode_runner" in engine_kw:
        assert served and all(sorted(layers) == [0, 1, 2] for layers in served)
    assert len(recorder.calls) > 50
    for tokens, drafts in recorder.calls[:: len(recorder.calls) // 25]:  # a spread of them: each costs k forwards
        assert drafts == reference_drafts(model, head, tokens, len(drafts)), len(tokens)


def _always_draft(monkeypatch):
    from hf_paged.spec_decode.speculator import Speculator

    monkeypatch.setattr(Speculator, "num_drafts", lambda self, state, max_len, cost=0.0: min(
        3, state.params.max_tokens - len(state.output_token_ids) - 1))


def _check_drafts(model, head, calls, since=0, every=20):
    picked = calls[since:][:: max(1, len(calls[since:]) // every)]
    for tokens, drafts in picked:
        assert drafts == reference_drafts(model, head, tokens, len(drafts)), len(tokens)


@pytest.mark.parametrize("case", ["swap", "pool hit", "host tier hit", "hit on blocks of a request that never drafted"])
def test_drafts_after_a_swap_or_a_prefix_hit_equal_a_plain_forward(monkeypatch, case):
    """Positions the target did not compute again (swapped back in, prefix hits in the pool or the host tier):
    the head reads the KV it wrote for them, so its drafts are those of a plain forward over the history."""
    _always_draft(monkeypatch)
    drafting = [case != "hit on blocks of a request that never drafted"]
    if not drafting[0]:  # the first pass drafts nothing: the head's KV of its blocks is written when it finishes
        from hf_paged.spec_decode.speculator import Speculator

        always = Speculator.num_drafts
        monkeypatch.setattr(Speculator, "num_drafts", lambda *a, **kw: always(*a, **kw) if drafting[0] else 0)
    model = target()
    head = random_head(seed=2, draft_vocab=200, aux_layer_ids=[1, 3, 2])
    recorder = Recorder(monkeypatch)
    spec = dict(method="eagle3", model=head, num_speculative_tokens=3)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    if case == "swap":
        kw = dict(block_size=4, num_blocks=40, preemption_mode="swap", swap_space=1 << 22)
    elif case != "host tier hit":
        kw = dict(block_size=4, num_blocks=400, enable_prefix_caching=True)
    else:  # a pool one long prompt fills: the first prompts' blocks leave it for the host tier, then come back
        kw = dict(block_size=4, num_blocks=40, enable_prefix_caching=True, kv_offload_gb=0.01, max_num_seqs=1)
    engine = PagedGenerator(model, speculative_config=spec, **kw)
    prompts = PROMPTS if case == "swap" else PROMPTS[2:4]
    outs = []
    if case != "swap":  # the prompts once, so that their blocks are cached
        outs += engine.generate(prompts, params, use_tqdm=False)
    if case == "host tier hit":
        engine.generate(make_prompts(1, [120], seed=5), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    drafting[0] = True
    since = len(recorder.calls)
    outs += engine.generate(prompts, params, use_tqdm=False)
    stats = engine.stats()
    engine.kv_manager.check_consistency()
    engine.close()
    want = [stock_greedy(model, p, NEW) for p in prompts]
    assert [o.token_ids for o in outs] == want * (len(outs) // len(want))
    if case == "swap":
        assert stats.num_preemptions["swap"] > 0
    else:
        assert stats.prefix_cache_hits > 0
        if case == "host tier hit":
            assert stats.kv_tiers["host_hits"] > 0
    assert len(recorder.calls) - since > 10
    # a swapped sequence's drafts: every one of them (where the head forgot, few drafts show it)
    _check_drafts(model, head, recorder.calls, since, every=1000 if case == "swap" else 10)


def _exact_first_two_token_distribution(model, prompt):
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        batch = torch.tensor([prompt + [t] for t in range(p1.shape[0])])
        p2 = model(batch).logits[:, -1].softmax(-1)
    return p1[:, None] * p2


def test_sampling_with_an_eagle_head_is_lossless_chi_square():
    """The first two tokens follow the target's exact distribution when a random head drafts the second
    (as the draft-model test in test_spec_decode.py: 4000 seeded requests, Pearson's chi-square, p > 0.001)."""
    from scipy.stats import chisquare

    kw = dict(vocab_size=6, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
              initializer_range=0.6)
    model = make_model("llama", seed=3, num_hidden_layers=LAYERS, **kw)
    torch.manual_seed(5)
    head = EagleHead(EagleHeadConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                                     vocab_size=6, aux_layer_ids=[1, 2, 3]))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.6)
    prompt = [1, 2, 3]
    expected = _exact_first_two_token_distribution(model, prompt).flatten().double()
    n = 4000
    engine = PagedGenerator(model, block_size=4, num_blocks=6000, max_num_seqs=256, enable_prefix_caching=False,
                            speculative_config=dict(method="eagle3", model=head, num_speculative_tokens=2))
    outs = engine.generate([prompt] * n, [SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, seed=s)
                                          for s in range(n)], use_tqdm=False)
    counts = torch.zeros(36)
    for o in outs:
        counts[o.token_ids[0] * 6 + o.token_ids[1]] += 1
    exp = expected * n
    obs_m, exp_m, acc_o, acc_e = [], [], 0.0, 0.0
    for i in exp.argsort().tolist():  # merge cells expected under 5
        acc_o += counts[i].item()
        acc_e += exp[i].item()
        if acc_e >= 5:
            obs_m.append(acc_o)
            exp_m.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e:
        obs_m[-1] += acc_o
        exp_m[-1] += acc_e
    scale = sum(obs_m) / sum(exp_m)
    assert chisquare(obs_m, [e * scale for e in exp_m]).pvalue > 1e-3
    stats = engine.stats()
    assert stats.spec_num_drafts > n // 2 and 0 < stats.spec_acceptance_rate < 1
    engine.close()


@pytest.mark.spec_gate
@pytest.mark.parametrize("limit", ["auto", None])
def test_the_gate_stops_drafting_where_measured_steps_cost_and_dormant_rows_are_not_settled(monkeypatch, head_dir,
                                                                                             limit):
    """Steps that verify drafts are made to measure 3x a plain step: at batch 5 the gate ("auto", the default)
    stops drafting after its first measurements, the head then neither drafts nor catches up over the finished
    sequences' rows, and the output is the same; None drafts at any batch size, as vLLM does."""
    from hf_paged.core.scheduler import Scheduler

    _always_draft(monkeypatch)
    observe = Scheduler.observe_step
    monkeypatch.setattr(Scheduler, "observe_step", lambda self, out, seconds, result=None: observe(
        self, out, 0.03 if any(s.num_draft_tokens for s in out.scheduled) else 0.01, result))
    settled = []
    settle = EagleProposer.settle
    monkeypatch.setattr(EagleProposer, "settle", lambda self, states, tables: (
        settled.extend(s.seq_id for s in states if s.seq_id in self.active), settle(self, states, tables)))
    model = target()
    want = [stock_greedy(model, p, NEW) for p in PROMPTS]
    spec = dict(method="eagle3", model=head_dir, num_speculative_tokens=3, disable_by_batch_size=limit)
    outs, stats = run(model, PROMPTS, spec, block_size=4, num_blocks=400)
    assert [o.token_ids for o in outs] == want
    if limit == "auto":
        assert 5 <= stats.spec_num_drafts <= 5 * 3  # its first steps of 5 sequences, no more
        assert settled == []  # every sequence ended dormant: nothing is caught up for the prefix cache
    else:
        assert stats.spec_num_drafts >= 5 * 5 and settled  # (the last ones finish as the engine stops)


# -- 3. what is reported ---------------------------------------------------------------------------------


def test_acceptance_is_reported_per_request_and_sums_to_the_engine_counts(head_dir):
    model = target()
    engine = PagedGenerator(model, block_size=4, num_blocks=400,
                            speculative_config=dict(method="eagle3", model=head_dir, num_speculative_tokens=3))
    params = [SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, num_speculative_tokens=k) for k in (3, 0, 2)]
    outs = engine.generate(PROMPTS[:3], params, use_tqdm=False)
    stats = engine.stats()
    assert outs[1].spec_decode is None  # it asked for no drafts
    mine = [o.spec_decode for o in outs if o.spec_decode is not None]
    assert len(mine) == 2 and all(s.num_drafts > 0 for s in mine)
    assert sum(s.num_drafts for s in mine) == stats.spec_num_drafts
    assert sum(s.num_draft_tokens for s in mine) == stats.spec_num_draft_tokens
    assert sum(s.num_accepted_tokens for s in mine) == stats.spec_num_accepted_tokens
    per_position = [sum(v) for v in zip(*(s.accepted_per_position + [0] * 3 for s in mine))][: len(stats.spec_accepted_per_position)]
    assert per_position == stats.spec_accepted_per_position
    for s in mine:
        assert s.mean_acceptance_length == 1 + s.num_accepted_tokens / s.num_drafts
        assert len(s.accepted_per_position) <= 3 and sum(s.accepted_per_position) == s.num_accepted_tokens
    engine.close()


def test_metrics_endpoint_exports_acceptance_by_position():
    pytest.importorskip("prometheus_client")
    from hf_paged.outputs import EngineStats
    from hf_paged.serving.metrics import ServingMetrics

    stats = EngineStats(0, 0, 0, 10, 0, 0, 0.0, 0, 0, {}, 0, 0, 0, 0, spec_num_drafts=4, spec_num_draft_tokens=12,
                        spec_num_accepted_tokens=5, spec_accepted_per_position=[3, 2, 0])

    class Engine:  # what the metrics read of an engine loop
        num_rejected: dict = {}
        num_waiting = 0

        def add_observer(self, fn):
            pass

        def stats(self, timeout=None):
            return stats

    text = ServingMetrics(Engine(), "m").render_blocking().decode()
    assert 'hf_paged:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 3.0' in text
    assert 'hf_paged:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' in text
    assert 'hf_paged:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert stats.spec_mean_acceptance_length == 1 + 5 / 4


# -- 4. the trainer --------------------------------------------------------------------------------------


def peaked_target():
    """A tiny target whose next-token distributions are peaked (a head has something to learn)."""
    return make_model("llama", num_hidden_layers=LAYERS, initializer_range=0.5, vocab_size=128)


def _train(out, **kw):
    from hf_paged.train.eagle import TrainConfig, train_eagle

    model = peaked_target()
    prompts = [[t % 128 for t in p] for p in make_prompts(8, seed=11)]
    cfg = TrainConfig(tokens=160, max_tokens=20, draft_vocab_size=96, epochs=4, save_every=5, lr=3e-3, **kw)
    return train_eagle(model, None, str(out), cfg, prompts, engine_kwargs=dict(block_size=16, num_blocks=200),
                       progress=False)


def test_trainer_writes_a_head_that_fits_its_data_better_and_resumes_to_the_same_weights(tmp_path):
    from hf_paged.train.eagle import init_head, text_loss

    whole = _train(tmp_path / "whole")
    _train(tmp_path / "parts", max_steps=10)  # interrupted after 10 of 32 texts
    state = torch.load(tmp_path / "parts" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 10
    resumed = _train(tmp_path / "parts")  # the same --out: its data and state are reused
    for key, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key

    model = peaked_target()
    assert not any(m._forward_hooks for m in model.modules())  # none left behind: the native program needs that
    head = load_head(str(tmp_path / "whole"), model)  # the layout vLLM reads, the target's embedding shared
    assert head.embed_tokens is None and head.config.draft_vocab_size == 96
    data = torch.load(tmp_path / "whole" / "train_data.pt", weights_only=False)
    assert sum(len(r.tokens) for r in data["records"]) >= 160
    vocab = data["vocab"]
    assert head.to_target(torch.arange(96)).tolist() == vocab.tolist() and head.t2d.sum() == 96
    fresh = init_head(model, head.config, vocab, seed=0)
    model_head = model.lm_head.weight.detach()[vocab]
    with torch.no_grad():
        before = sum(text_loss(fresh, model_head, r, 3)[0] for r in data["records"])
        after = sum(text_loss(head, model_head, r, 3)[0] for r in data["records"])
    assert after < 0.9 * before

    prompts = [[t % 128 for t in p] for p in PROMPTS]
    want = [stock_greedy(model, p, NEW) for p in prompts]
    outs, stats = run(model, prompts, dict(method="eagle3", model=str(tmp_path / "whole"), num_speculative_tokens=3),
                      block_size=4, num_blocks=400)
    assert [o.token_ids for o in outs] == want and stats.spec_num_drafts > 0


def test_train_eagle_command_line(tmp_path):
    from hf_paged.cli.commands import main
    from tests.serving_helpers import default_tokenizer, tiny_chat_model

    tokenizer = default_tokenizer()
    model = tiny_chat_model(tokenizer)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "Hi there"}]}\n{"prompt": "Once upon a time"}\n')
    args = ["train-eagle", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "head"), "--tokens", "30",
            "--max-tokens", "8", "--draft-vocab-size", "64", "--epochs", "1", "--prompts", str(prompts), "--quiet"]
    assert main(args) == 0
    head = load_head(str(tmp_path / "head"), model)
    assert head.config.draft_vocab_size == 64 and head.config.aux_layer_ids == [1, 1, 1]  # vLLM's (2, 1, -1) kept inside a 2-layer target
    assert main([*args[:-3], "--prompts", str(tmp_path / "nope.jsonl")]) != 0


def test_rows_of_rejected_drafts_are_replaced_and_pending_rows_are_capped(monkeypatch):
    from hf_paged.spec_decode.eagle import proposer as eagle_proposer

    p = EagleProposer.__new__(EagleProposer)
    p.pending = {}
    rows = lambda start, n: torch.arange(start, start + n, dtype=torch.float32)[:, None]  # noqa: E731
    kept = lambda seq: (p.pending[seq].start, p.pending[seq].tensor()[:, 0].tolist())  # noqa: E731
    p._append(1, 0, rows(0, 10))  # a prompt
    p._append(1, 9, rows(100, 4))  # last token + 3 drafts verified at 9
    p._append(1, 11, rows(200, 2))  # one draft accepted: the next step starts at 11, over the rejected rows
    assert kept(1) == (0, [*range(9), 100, 101, 200, 201])
    assert len(p.pending[1].chunks) == 1  # reading joined the chunks once
    p._append(1, 13, rows(300, 1))
    p._append(1, 14, rows(400, 1))
    assert p.pending[1].length == 15 and len(p.pending[1].chunks) == 3  # appends do not copy what is held
    p.pending[3] = p.pending[1].copy()  # a fork: its own list, the parent's appends do not reach it
    p._append(1, 15, rows(500, 1))
    assert p.pending[3].length == 15 and p.pending[1].length == 16
    p._append(2, 5, rows(0, 3))  # not contiguous with nothing kept: starts there
    assert p.pending[2].start == 5
    monkeypatch.setattr(eagle_proposer, "MAX_PENDING", 4)
    p._append(1, 13, rows(600, 2))
    assert kept(1) == (11, [200, 201, 600, 601])


# -- 5. EAGLE-1 heads ------------------------------------------------------------------------------------


def random_eagle1(seed=0, fc_bias=False, **kw):
    from hf_paged.spec_decode.eagle import Eagle1Head

    torch.manual_seed(seed)
    head = Eagle1Head(head_config(**kw), fc_bias=fc_bias)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.15)
    return head


def eagle1_reference_drafts(model, head, tokens, k):
    """An EAGLE-1 head's greedy drafts computed plainly from the target's last hidden state (after its norm)."""
    from hf_paged.train.eagle_data import target_states

    _, final = target_states(model, tokens, (LAYERS - 1,))
    with torch.no_grad():
        fed, ids, drafts = final[:-1], list(tokens[1:]), []
        for _ in range(k):
            out = head(torch.tensor(ids), torch.arange(len(ids)), fed, causal_attend)
            token = int(model.lm_head(out[-1:]).argmax(-1))
            drafts.append(token)
            ids.append(token)
            fed = torch.cat([fed, out[-1:]])
    return drafts


def test_eagle1_head_saves_in_vllms_layout_and_loads_back(tmp_path):
    from safetensors.torch import load_file, save_file

    head = random_eagle1(seed=3, fc_bias=True)
    folder = str(tmp_path / "e1")
    save_head(head, folder)
    names = set(load_file(os.path.join(folder, "model.safetensors")))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.post_attention_layernorm.weight"} <= names
    assert not any(n.startswith("midlayer.") or "input_layernorm" in n or n.startswith("lm_head") for n in names)
    assert json.load(open(os.path.join(folder, "config.json")))["architectures"] == ["EagleLlamaForCausalLM"]
    # a checkpoint with vLLM's "model." prefix and the input_layernorm the published heads leave unused
    state = {("model." + k if k != "fc.weight" else k): v for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    state["model.layers.0.input_layernorm.weight"] = torch.ones(64)
    save_file(state, os.path.join(folder, "model.safetensors"))
    model = target()
    loaded = load_head(folder, model, method="eagle")
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in loaded.state_dict().items())
    x = torch.randn(5, 64)
    assert torch.equal(loaded.logits(x), model.lm_head(x))  # the target's lm_head
    assert torch.equal(loaded.feed(x), model.model.norm(x))  # the target's final norm


def test_eagle1_wrong_folders_are_clear_errors(tmp_path, head_dir):
    folder = str(tmp_path / "e1")
    save_head(random_eagle1(), folder)
    with pytest.raises(ValueError, match="EAGLE-3 head.*use method 'eagle3'"):
        load_head(head_dir, target(), method="eagle")
    with pytest.raises(ValueError, match="EAGLE-1 head.*use method 'eagle'"):
        load_head(folder, target())
    with pytest.raises(ValueError, match="no config.json"):
        load_head(str(tmp_path), target(), method="eagle")
    _break(folder, drop="layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="not an EAGLE-1 head.*up_proj"):
        load_head(folder, target(), method="eagle")
    with pytest.raises(ValueError, match="hidden size of 64, the target's is 32"):
        load_head(_fresh_eagle1(tmp_path), target(hidden_size=32, num_attention_heads=2), method="eagle")


def _fresh_eagle1(tmp_path):
    folder = str(tmp_path / "e1b")
    save_head(random_eagle1(), folder)
    return folder


@pytest.mark.parametrize("engine_kw", [dict(block_size=4, num_blocks=400),
                                       dict(block_size=4, num_blocks=40, preemption_mode="swap", swap_space=1 << 22)])
def test_eagle1_greedy_output_equals_stock_generate_and_drafts_equal_a_plain_forward(monkeypatch, tmp_path, engine_kw):
    _always_draft(monkeypatch)
    model = target()
    folder = str(tmp_path / "e1")
    save_head(random_eagle1(seed=4), folder)
    head = load_head(folder, model, method="eagle")
    recorder = Recorder(monkeypatch)
    outs, stats = run(model, PROMPTS, dict(method="eagle", model=folder, num_speculative_tokens=3), **engine_kw)
    assert [o.token_ids for o in outs] == [stock_greedy(model, p, NEW) for p in PROMPTS]
    assert stats.spec_num_draft_tokens > 0
    calls = recorder.calls
    assert len(calls) > 20
    for tokens, drafts in calls[:: max(1, len(calls) // 15)]:
        assert drafts == eagle1_reference_drafts(model, head, tokens, len(drafts)), len(tokens)


def test_init_layer_copies_the_targets_last_layer_and_greedy_first_answers_greedily():
    from hf_paged.train.eagle import copy_last_layer, head_config_for, init_head
    from hf_paged.train.eagle_data import generate_texts

    model = peaked_target()
    cfg = head_config_for(model, 96)
    cfg.aux_layer_ids = [1, 2, 3]
    head = init_head(model, cfg, torch.arange(96), seed=0)
    assert copy_last_layer(model, head)
    last, mid = model.model.layers[-1], head.midlayer
    assert torch.equal(mid.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.equal(mid.self_attn.o_proj.weight, last.self_attn.o_proj.weight)
    assert torch.equal(mid.hidden_norm.weight, last.input_layernorm.weight)
    assert torch.equal(mid.self_attn.k_proj.weight, torch.cat([last.self_attn.k_proj.weight] * 2, dim=1))
    assert not copy_last_layer(target(hidden_size=32, num_attention_heads=2), head)  # shapes differ: left as is

    prompts = [[t % 128 for t in p] for p in make_prompts(3, [5, 7, 9], seed=11)]
    texts = generate_texts(model, None, prompts, tokens=30, max_tokens=8, seed=0,
                           engine_kwargs=dict(block_size=16, num_blocks=200), greedy_first=True)
    assert texts[:3] == [p + stock_greedy(model, p, 8) for p in prompts]  # the first pass: greedy answers
    assert len(texts) > 3 and texts[3][:5] == prompts[0] and texts[3] != texts[0]  # then sampled ones
