"""Prefill pacing (``max_itl_ratio``): chunk sizes from measured step times, shared by the prompts of a step."""

import pytest
import torch
import transformers

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.config import EngineConfig
from hf_paged.core.prefill_pacer import PrefillPacer
from tests.test_scheduler import make_request, make_scheduler, run_step, sched_view


def test_pacer_prices_prefill_tokens_against_the_decode_step():
    pacer = PrefillPacer(3.0, min_chunk=4, margin=0.75)
    assert pacer.cap() == 4  # nothing measured yet: the smallest chunk
    pacer.observe(0.020, num_decode_rows=1, num_prefill_tokens=0)
    assert pacer.decode_seconds == pytest.approx(0.020)
    pacer.observe(0.024, num_decode_rows=1, num_prefill_tokens=4)  # 1 ms a prefill token
    # budget (3 - 1) * 20 ms * 0.75 = 30 ms = 30 tokens, but at most twice the previous cap
    assert pacer.cap() == 8
    pacer.observe(0.028, num_decode_rows=1, num_prefill_tokens=8)
    assert pacer.cap() == 16
    pacer.observe(0.036, num_decode_rows=1, num_prefill_tokens=16)
    assert pacer.cap() == 30  # the fit
    pacer.observe(0.100, num_decode_rows=1, num_prefill_tokens=30)  # tokens got dear (long context): 2.67 ms
    assert pacer.cap() == 11
    pacer.observe(0.500, num_decode_rows=1, num_prefill_tokens=11)  # dearer than the budget allows: the floor
    assert pacer.cap() == 4
    # steps where nothing decodes teach nothing (no stream waited); decode-only steps move the average
    pacer.observe(5.0, num_decode_rows=0, num_prefill_tokens=500)
    assert pacer.cap() == 4 and pacer.decode_seconds == pytest.approx(0.020)
    pacer.observe(0.030, num_decode_rows=4, num_prefill_tokens=0)
    assert pacer.decode_seconds == pytest.approx(0.7 * 0.020 + 0.3 * 0.030)


@pytest.mark.parametrize("bad, error", [(1.0, ValueError), (0.5, ValueError), (-3, ValueError),
                                        (float("inf"), ValueError), ("3", TypeError), (True, TypeError)])
def test_max_itl_ratio_checks(bad, error):
    with pytest.raises(error, match=f"max_itl_ratio must be a number > 1.*{bad!r}" if error is TypeError
                       else "max_itl_ratio must be a number > 1"):
        EngineConfig(max_itl_ratio=bad)
    with pytest.raises(error, match="max_itl_ratio"):
        make_scheduler(max_itl_ratio=bad)


def test_engine_config_default_paces_at_three():
    assert EngineConfig().max_itl_ratio == 3.0
    assert EngineConfig(max_itl_ratio=None).max_itl_ratio is None
    assert make_scheduler(max_itl_ratio=0).pacer is None


def test_paced_cap_applies_to_each_arriving_prompt():
    # no token threshold, pacing only: while "a" decodes, each arriving prompt gets up to the pacer's cap a step
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=64, max_model_len=64,
                           long_prefill_token_threshold=None, max_itl_ratio=3.0)
    sched.add_request(make_request("a", 4, max_tokens=30))
    assert sched_view(sched, run_step(sched)) == [("a", 0, 4, True)]  # nothing decodes yet: no cap
    sched.add_request(make_request("b", 10, max_tokens=4, first=20))
    sched.add_request(make_request("c", 3, max_tokens=4, first=40))
    out = run_step(sched)
    assert sched_view(sched, out) == [("a", 4, 1, True), ("b", 0, 4, False), ("c", 0, 3, True)]  # cap 4 each
    sched.observe_step(out, 0.024)  # no decode-only time yet: nothing learned
    assert sched.pacer.cap() == 4
    sched.pacer.observe(0.020, 1, 0)  # a decode-only step: 20 ms
    sched.observe_step(out, 0.027)  # 7 prefill tokens beside the decodes cost 7 ms: 1 ms a token; cap 4 -> 8
    assert sched.pacer.cap() == 8
    out = run_step(sched)
    assert sched_view(sched, out) == [("a", 5, 1, True), ("b", 4, 6, True), ("c", 3, 1, True)]
    sched.add_request(make_request("d", 40, max_tokens=2, first=60))
    out = run_step(sched)
    assert ("d", 0, 8, False) in sched_view(sched, out)
    sched.observe_step(out, 0.040)  # 8 tokens cost 20 ms (the decodes share it): 2.5 ms a token -> 12
    assert sched.pacer.cap() == 12
    assert ("d", 8, 12, False) in sched_view(sched, run_step(sched))
    while sched.has_unfinished_requests():
        run_step(sched)
    assert sched.kv.pool.num_free_blocks == 64


def test_paced_engine_chunks_an_arriving_prompt_and_matches_stock_greedy():
    from tests.helpers import arrival_chunks, stock_greedy

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    engine = PagedGenerator(model, num_blocks=128, block_size=4, long_prefill_token_threshold=None, max_itl_ratio=3.0)
    short, long = [5, 6, 7, 8], [(i * 7) % 120 + 3 for i in range(90)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    chunks, done = arrival_chunks(engine, short, long, params)
    assert len(chunks) >= 3 and chunks[0] == 4 and sum(chunks) == len(long)  # paced: several chunks, 4 first
    assert done["short"] == stock_greedy(model, short, 24)
    assert done["long"] == stock_greedy(model, long, 24)
    assert engine.kv_manager.pool.num_free_blocks == 128
