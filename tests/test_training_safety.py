"""A plain forward/backward (training) is unchanged while an engine is attached to the model.

``PagedGenerator(model)`` switches the model to the "hf_paged" attention implementation. Without engine
metadata its attention and mask functions must defer to the original implementation, so loss and gradients
stay bit-identical. transformers' own paged mode broke this: its no-op mask made the forward silently
non-causal. The guard test shows our checks would catch exactly that bug.
"""

import pytest
import torch

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.attention import function as attention
from tests.arch_configs import WINDOW, make_arch_model
from tests.helpers import make_prompts, stock_greedy

SEQ = 40  # longer than the sliding window (24), so the window shows in the mask

# (arch, original implementation): sdpa and eager for a full-attention and a sliding-window model, and
# gemma2 (eager only: softcap, sliding/full layers), gpt2 (learned positions, dropout 0.1 in train mode).
CASES = [
    ("llama", "sdpa"),
    ("llama", "eager"),
    ("mistral", "sdpa"),
    ("mistral", "eager"),
    ("gemma2", "eager"),
    ("gpt2", "sdpa"),
]


def training_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three rows: unpadded, left-padded by 9, right-padded by 13; labels ignore the padding."""
    ids = torch.tensor(make_prompts(3, [SEQ] * 3, seed=11))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[2, -13:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def loss_and_grads(model, ids, mask, labels) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # gpt2 has dropout: the same draws before and after
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def all_results(model) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    ids, mask, labels = training_batch()
    model.train()
    try:
        return {
            "padded": loss_and_grads(model, ids, mask, labels),
            "no_mask": loss_and_grads(model, ids[:1], None, ids[:1]),
        }
    finally:
        model.eval()


def assert_identical(a, b) -> None:
    for case in a:
        (loss_a, grads_a), (loss_b, grads_b) = a[case], b[case]
        assert torch.equal(loss_a, loss_b), f"{case}: loss {loss_a.item()} != {loss_b.item()}"
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), f"{case}: gradient of {name} changed"


@pytest.mark.parametrize("arch,impl", CASES)
def test_loss_and_gradients_unchanged_while_engine_attached(arch, impl):
    model = make_arch_model(arch, seed=1, attn_implementation=impl)  # seed 1: not shared with the matrix
    before = all_results(model)
    assert len(before["padded"][1]) == len(list(model.parameters()))  # every parameter got a gradient
    engine = PagedGenerator(model, block_size=4, num_blocks=128, max_num_batched_tokens=32)
    try:
        assert model.config._attn_implementation == "hf_paged"
        engine.generate(make_prompts(2, [SEQ, 5]), SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        during = all_results(model)
    finally:
        engine.close()
    assert model.config._attn_implementation == impl
    assert_identical(before, during)


@pytest.mark.parametrize("arch,impl", [("mistral", "sdpa"), ("mistral", "eager"), ("gemma2", "eager")])
def test_stock_generate_unchanged_while_engine_attached(arch, impl):
    """Stock generate (DynamicCache, masks with a cache offset) still runs the original implementation."""
    model = make_arch_model(arch, seed=1, attn_implementation=impl)
    prompt = make_prompts(1, [SEQ + WINDOW], seed=12)[0]
    want = stock_greedy(model, prompt, 12)
    engine = PagedGenerator(model, num_blocks=64)
    try:
        assert stock_greedy(model, prompt, 12) == want
    finally:
        engine.close()


@pytest.mark.parametrize("arch,impl", [("llama", "eager"), ("mistral", "sdpa"), ("mistral", "eager")])
def test_guard_a_no_op_mask_would_be_caught(arch, impl):
    """With the mask function returning None (what it does inside an engine step, and what transformers'
    paged mode did everywhere), the same training forward gives a different loss: the test above is real."""
    model = make_arch_model(arch, seed=1, attn_implementation=impl)
    engine = PagedGenerator(model, num_blocks=64)
    try:
        good = all_results(model)
        with attention.engine_forward():  # the mask function now returns None
            broken = all_results(model)
    finally:
        engine.close()
    assert not torch.equal(good["padded"][0], broken["padded"][0])


def test_engine_follows_weights_updated_by_training():
    """Train a step while the engine is attached: its next generation uses the new weights."""
    model = make_arch_model("llama", seed=2)  # seed 2: this test changes the weights of its own model
    prompt = make_prompts(1, [30], seed=13)[0]
    greedy = SamplingParams(max_tokens=12, temperature=0)
    engine = PagedGenerator(model, block_size=4, num_blocks=64)
    try:
        before = engine.generate([prompt], greedy, use_tqdm=False)[0].token_ids
        ids, mask, labels = training_batch()
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        model.eval()
        want = stock_greedy(model, prompt, 12)
        assert want != before  # the step really changed the model
        assert engine.generate([prompt], greedy, use_tqdm=False)[0].token_ids == want
    finally:
        engine.close()
