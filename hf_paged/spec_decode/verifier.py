"""Verification of drafted tokens: the target model's own distribution decides, so output is lossless.

The target scores ``[last, d1 .. dk]`` in one forward; row i holds the logits for the token after
``d_i`` (row 0: after the last token). Each row is processed exactly as plain decoding would process it
with ``d1 .. d_i`` appended to the history (``min_tokens`` bans, repetition penalty, temperature, top-k,
top-p, min-p), then:

- greedy requests accept drafts while they equal the row's argmax, then take the target's own token;
- sampled requests use rejection sampling. Our drafts (n-gram, greedy draft model) are deterministic, so the
  draft distribution ``q`` is one-hot: ``d_i`` is accepted with probability ``min(1, p(d_i) / q(d_i)) =
  p(d_i)``; on rejection the token is drawn from ``norm(max(p - q, 0))``, i.e. ``p`` without ``d_i``. Every
  draw comes from the request's own generator when it has a seed. When all drafts are accepted a bonus
  token is drawn from the last row. The emitted token at each position is then distributed exactly as ``p``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_paged.sample.sampling import Sampler, SeqState


def verify(
    sampler: Sampler,
    logits: torch.Tensor,  # [sum(k_j + 1), V] raw target logits, sequence by sequence
    states: Sequence[SeqState],
    drafts: Sequence[list[int]],
    scores: dict[int, list] | None = None,
) -> list[list[int]]:
    """The tokens each sequence emits this step: its accepted drafts followed by one target token."""
    expanded: list[SeqState] = []
    extras: list[list[int]] = []
    for state, draft in zip(states, drafts):
        for i in range(len(draft) + 1):
            expanded.append(state)
            extras.append(draft[:i])
    processed, random_rows = sampler.process(logits, expanded, extras)
    targets = processed.argmax(dim=-1).tolist()
    sampled = set(random_rows)
    emitted: list[list[int]] = []
    row = 0
    for state, draft in zip(states, drafts):
        k = len(draft)
        if row in sampled:
            tokens = _rejection_sample(sampler, processed[row : row + k + 1], state, draft)
        else:
            tokens = []
            for i in range(k):
                if draft[i] != targets[row + i]:
                    break
                tokens.append(draft[i])
            tokens.append(targets[row + len(tokens)])
        if scores is not None and state.want_scores:
            scores[state.seq_id] = [processed[row + i].clone() for i in range(len(tokens))]
        emitted.append(tokens)
        row += k + 1
    return emitted


def _rejection_sample(sampler: Sampler, processed: torch.Tensor, state: SeqState, draft: list[int]) -> list[int]:
    probs = processed.softmax(dim=-1)  # [k + 1, V]
    gen = state.get_generator(probs.device) or sampler.generator
    uniforms = torch.rand(len(draft), generator=gen, device=probs.device).tolist()
    accept_p = probs[torch.arange(len(draft)), torch.tensor(draft, dtype=torch.long)].tolist() if draft else []
    tokens: list[int] = []
    for i, d in enumerate(draft):
        if uniforms[i] < accept_p[i]:
            tokens.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0  # max(p - q, 0) with a one-hot q
        tokens.append(_draw(sampler, residual, state))
        return tokens
    tokens.append(_draw(sampler, probs[len(draft)], state))  # bonus token
    return tokens


def _draw(sampler: Sampler, weights: torch.Tensor, state: SeqState) -> int:
    """One token with probability proportional to ``weights`` (an exponential race, as the sampler does)."""
    noise = sampler.exponential_noise([state], weights.shape[-1], weights.device)[0]
    return int((weights / noise).argmax())
