"""A request's own speculative configuration: its proposer (a draft model to load, a probe forward) is built
where the steps run, at admission, never on the caller's thread beside a forward (reliability issue, item 6)."""

import threading

import pytest
import transformers

from hf_paged import AsyncPagedEngine, PagedGenerator, SamplingParams
from tests.helpers import make_model, make_prompts, stock_greedy

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_proposer_is_built_on_the_loop_thread_and_a_failing_one_fails_only_its_request():
    model = make_model("llama", seed=11)
    prompt = make_prompts(1, [9], seed=4)[0]
    loop = AsyncPagedEngine(PagedGenerator(model, num_blocks=256, block_size=4, max_num_seqs=8))
    try:
        built_on = []
        executor = loop.engine.executor
        add = executor.add_proposer

        def spy(key, spec):
            built_on.append(threading.current_thread())
            return add(key, spec)

        executor.add_proposer = spy
        spec = {"method": "draft_model", "model": "self:1", "num_speculative_tokens": 2}
        stream = loop.add_request(prompt, GREEDY, speculative_config=spec)  # validation only, on this thread
        assert built_on == []
        out = loop.generate(prompt, GREEDY, speculative_config=spec)  # the same proposer: built once
        assert built_on == [loop._thread]
        assert list(out.outputs[0].token_ids) == stock_greedy(model, prompt, 10)
        # a draft model that cannot serve this target (another vocabulary) fails its own request only
        other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=4096,
        )).eval()
        bad = loop.generate(prompt, GREEDY, speculative_config={"method": "draft_model", "model": other,
                                                                "num_speculative_tokens": 2})
        assert bad.outputs[0].finish_reason == "error" and "vocabulary" in bad.outputs[0].error
        assert list(loop.generate(prompt, GREEDY).outputs[0].token_ids) == stock_greedy(model, prompt, 10)
        del stream
    finally:
        loop.shutdown()


def test_direct_add_request_still_raises_a_bad_draft_model_and_admits_nothing():
    model = make_model("llama", seed=11)
    with PagedGenerator(model, num_blocks=64, block_size=4) as engine:
        with pytest.raises(ValueError, match="no such folder"):
            engine.add_request([1, 2, 3], GREEDY, speculative_config={"method": "draft_model", "model": "/nonexistent",
                                                                      "num_speculative_tokens": 2})
        assert not engine.has_unfinished_requests()
