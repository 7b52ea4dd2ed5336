"""Sampling masks against direct per-row implementations, and the sampler's distribution and seeding."""

import torch

from hf_paged.sample.sampling import Sampler, SeqState, apply_min_p, apply_top_k_top_p
from hf_paged.sampling_params import SamplingParams


def direct_top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    if k == 0 or k >= row.numel():
        return torch.zeros_like(row, dtype=torch.bool)
    kth = row.sort(descending=True).values[k - 1]
    return row < kth


def direct_top_p(row: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the most likely tokens until their mass reaches p (the token crossing p included)."""
    probs = row.softmax(-1)
    drop = torch.ones_like(row, dtype=torch.bool)
    mass = 0.0
    for idx in probs.argsort(descending=True).tolist():
        if mass >= p:
            break
        drop[idx] = False
        mass += probs[idx].item()
    return drop


def test_top_k_top_p_match_direct_implementation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    top_k = torch.tensor([0, 1, 5, 20, 50, 7])
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.3, 0.75, 1.0])
    got = apply_top_k_top_p(logits, top_k, None)
    for i in range(6):
        assert torch.equal(got[i].isinf(), direct_top_k(logits[i], int(top_k[i])))
    got = apply_top_k_top_p(logits, None, top_p)
    for i in range(6):
        want = direct_top_p(logits[i], float(top_p[i])) if top_p[i] < 1 else torch.zeros(50, dtype=torch.bool)
        assert torch.equal(got[i].isinf(), want), i
    both = apply_top_k_top_p(logits, top_k, top_p)
    for i in range(6):
        after_k = logits[i].masked_fill(direct_top_k(logits[i], int(top_k[i])), float("-inf"))
        want = direct_top_k(logits[i], int(top_k[i]))
        if top_p[i] < 1:
            want |= direct_top_p(after_k, float(top_p[i]))
        assert torch.equal(both[i].isinf(), want), i


def test_min_p_matches_direct_implementation():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g) * 2
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0])
    got = apply_min_p(logits, min_p)
    for i in range(4):
        probs = logits[i].softmax(-1)
        want = probs < min_p[i] * probs.max()
        assert torch.equal(got[i].isinf(), want)
    assert got[3].isfinite().sum() == 1  # min_p = 1 keeps only the top token


_ids = iter(range(10**9))


def make_req(rid, stop_token_ids=frozenset(), **kw):
    return SeqState(next(_ids), [1], [], SamplingParams(**kw), frozenset(stop_token_ids))


def test_greedy_rows_take_argmax_and_sampled_rows_follow_the_distribution():
    sampler = Sampler(torch.device("cpu"), seed=0)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20000
    logits = probs.log().repeat(n, 1)
    reqs = [make_req(f"r{i}", temperature=1.0) for i in range(n)]
    tokens = torch.tensor(sampler.sample(logits, reqs))
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.015), freq
    greedy = sampler.sample(logits[:3], [make_req("g", temperature=0.0)] * 3)
    assert greedy == [3, 3, 3]


def test_temperature_sharpens_and_top_k_restricts():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(4000, 1)
    cold = torch.tensor(sampler.sample(logits, [make_req(str(i), temperature=0.2) for i in range(4000)]))
    assert (cold == 3).float().mean() > 0.99
    k2 = torch.tensor(sampler.sample(logits, [make_req(str(i), temperature=5.0, top_k=2) for i in range(4000)]))
    assert set(k2.tolist()) == {2, 3}


def test_seeded_rows_do_not_depend_on_neighbours():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(3))

    def draw(order_seed):
        sampler = Sampler(torch.device("cpu"), seed=order_seed)
        req = make_req("seeded", temperature=1.0, seed=42)
        others = [make_req(f"o{i}", temperature=1.0) for i in range(4)]
        rows = [sampler.sample(torch.cat([logits[:1], logits[1:]]), [req, *others])[0] for _ in range(10)]
        return rows

    assert draw(0) == draw(1)


def test_min_tokens_masks_stop_tokens_even_for_greedy():
    sampler = Sampler(torch.device("cpu"))
    req = make_req("r", temperature=0.0, min_tokens=2, max_tokens=4, stop_token_ids={3})
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0]])
    assert sampler.sample(logits.clone(), [req]) == [2]
    req.output_token_ids = [2, 2]
    assert sampler.sample(logits.clone(), [req]) == [3]


def test_each_sequence_state_owns_its_generator():
    sampler = Sampler(torch.device("cpu"))
    req = make_req("x", temperature=1.0, seed=5)
    first = sampler.sample(torch.zeros(1, 1000), [req])
    second = sampler.sample(torch.zeros(1, 1000), [req])
    assert first != second  # consecutive draws of one generator differ
    fresh = make_req("x", temperature=1.0, seed=5)
    assert sampler.sample(torch.zeros(1, 1000), [fresh]) == first
    fork = req.fork(99, seed_offset=1)  # sample 1 of an n > 1 request: seed + 1
    alone = make_req("y", temperature=1.0, seed=6)
    assert sampler.sample(torch.zeros(1, 1000), [fork]) == sampler.sample(torch.zeros(1, 1000), [alone])


def test_exponential_noise_from_uniform_stays_positive_and_finite():
    """u = 0 (a 2^-24 chance per draw, so about once per few steps of 64 x 49152 draws) must not give E = 0:
    p / 0 would be inf for a live token and NaN for a masked (p = 0) one."""
    from hf_paged.sample.sampling import uniform_to_exponential_

    u = torch.tensor([0.0, 0.5, 1.0 - 2**-24, 2**-24])
    e = uniform_to_exponential_(u.clone())
    assert bool((e > 0).all()) and bool(torch.isfinite(e).all())
    torch.testing.assert_close(e[1:], -torch.log1p(-u[1:]))
    probs = torch.tensor([0.0, 0.5, 0.5, 0.0])
    assert int((probs / e).argmax()) in (1, 2)  # a zero-probability token never wins, even against E = tiny
    big = uniform_to_exponential_(torch.empty(200_000).uniform_(generator=torch.Generator().manual_seed(0)))
    assert abs(big.mean().item() - 1.0) < 0.01 and abs(big.var().item() - 1.0) < 0.02
