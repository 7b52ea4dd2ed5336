"""Token selection for one step: greedy rows by argmax, sampled rows by an exponential race.

Sampling ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. picks token i with probability ``p_i``. The noise
of a seeded request comes from its own generator, one fixed-size draw per sampled token, so its tokens
do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from hf_paged.sequence import Request


def apply_top_k_top_p(
    logits: torch.Tensor,  # [N, V]
    top_k: torch.Tensor | None,  # [N] int, 0 = off
    top_p: torch.Tensor | None,  # [N] float, 1 = off
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its nucleus of mass top_p."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab)
        drop |= ranks[None, :] >= k[:, None]
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self._seen: dict[str, tuple[torch.Tensor, int]] = {}  # repetition penalty: token mask, outputs counted

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._request_generators.pop(rid, None)
            self._seen.pop(rid, None)

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        gen = self._request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._request_generators[request.request_id] = gen
        return gen

    def _seen_mask(self, request: Request, vocab: int) -> torch.Tensor:
        """[V] bool: tokens of the prompt and output so far (kept per request, updated incrementally)."""
        entry = self._seen.get(request.request_id)
        if entry is None:
            mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            ids = [t for t in set(request.prompt_token_ids) if 0 <= t < vocab]
            mask[ids] = True
            entry = (mask, 0)
        mask, counted = entry
        new = request.output_token_ids[counted:]
        if new:
            mask[new] = True
        self._seen[request.request_id] = (mask, len(request.output_token_ids))
        return mask

    def _apply_repetition_penalty(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.repetition_penalty != 1.0]
        if not rows:
            return
        vocab = logits.shape[-1]
        idx = torch.tensor(rows, device=logits.device)
        seen = torch.stack([self._seen_mask(requests[i], vocab) for i in rows])
        penalty = torch.tensor([requests[i].sampling_params.repetition_penalty for i in rows], device=logits.device)[:, None]
        sub = logits.index_select(0, idx)
        # HF's RepetitionPenaltyLogitsProcessor: shrink the logits of every token already seen
        penalized = torch.where(sub < 0, sub * penalty, sub / penalty)
        logits.index_copy_(0, idx, torch.where(seen, penalized, sub))

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """Pick one token per row of ``logits [N, V]`` for ``requests[i]``."""
        logits = logits.float()
        vocab = logits.shape[-1]
        for i, req in enumerate(requests):
            if not req.stop_tokens_allowed and req.stop_token_ids:
                banned = [t for t in req.stop_token_ids if t < vocab]
                logits[i, banned] = float("-inf")
        self._apply_repetition_penalty(logits, requests)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if not random_rows:
            _capture_scores(logits, requests, range(len(requests)))
            return logits.argmax(dim=-1).tolist()
        tokens = logits.argmax(dim=-1)
        _capture_scores(logits, requests, (i for i, r in enumerate(requests) if r.sampling_params.greedy))
        sub_reqs = [requests[i] for i in random_rows]
        rows = torch.tensor(random_rows, device=logits.device)
        sub = logits.index_select(0, rows)
        params = [r.sampling_params for r in sub_reqs]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        sub = sub / temps[:, None]
        top_k = top_p = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=logits.device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        if top_k is not None or top_p is not None:
            sub = apply_top_k_top_p(sub, top_k, top_p)
        if any(p.min_p > 0 for p in params):
            sub = apply_min_p(sub, torch.tensor([p.min_p for p in params], device=logits.device))
        _capture_scores(sub, sub_reqs, range(len(sub_reqs)))
        probs = sub.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = []
        for j, req in enumerate(sub_reqs):
            gen = self._generator(req)
            if gen is None:
                unseeded.append(j)
            else:
                noise[j].exponential_(generator=gen)
        if unseeded:
            idx = torch.tensor(unseeded, device=logits.device)
            noise.index_copy_(0, idx, torch.empty(len(unseeded), vocab, device=logits.device).exponential_(generator=self.generator))
        tokens.index_copy_(0, rows, (probs / noise).argmax(dim=-1))
        return tokens.tolist()


def _capture_scores(processed: torch.Tensor, requests: Sequence[Request], rows: Iterable[int]) -> None:
    """Keep the processed logits row of requests that asked for them (HF ``output_scores``)."""
    for i in rows:
        if requests[i].scores is not None:
            requests[i].scores.append(processed[i].clone())
