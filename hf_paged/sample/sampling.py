"""Token selection for one step: greedy rows by argmax, sampled rows by an exponential race.

Sampling ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. picks token i with probability ``p_i``. The noise
of a seeded request comes from its own generator, one fixed-size draw per sampled token, so its tokens
do not depend on what else is in the batch.
"""

from __future__ import annotations

import math

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from hf_paged.core.scheduler_output import NewSequenceData
from hf_paged.kernels.cpu import fused_ops
from hf_paged.sample.logits_processors import apply_logits_processors, hooked_rows
from hf_paged.sampling_params import SamplingParams


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
    drop[:, 0] = False  # the most likely token always stays (a top_p below float32's range would drop it)
    drop = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


class NonFiniteLogits(ValueError):
    """The model produced NaN or infinite logits for some rows: sampling them would be garbage."""

    def __init__(self, seq_ids: list[int]) -> None:
        super().__init__(f"the model produced non-finite (NaN or inf) logits for sequence(s) {seq_ids}")
        self.seq_ids = seq_ids


@dataclass
class SeqState:
    """The runner's own record of a sequence: what sampling needs, kept across steps (plain data in, torch
    out). Created from :class:`NewSequenceData`, dropped when the scheduler reports the sequence finished."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    seed_offset: int = 0
    is_beam: bool = False
    want_scores: bool = False
    generator: torch.Generator | None = None
    seen: torch.Tensor | None = field(default=None, repr=False)  # [V] bool, repetition penalty
    seen_counted: int = 0
    spec_key: str | None = None  # the proposer drafting for this sequence (speculative decoding), if any
    spec_k: int = 0  # its most drafts per step
    spec_ema: float = 1.0  # moving average of the fraction of drafts accepted

    def record_acceptance(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.spec_ema = 0.7 * self.spec_ema + 0.3 * accepted / proposed

    @classmethod
    def from_new(cls, data: NewSequenceData) -> SeqState:
        return cls(data.seq_id, data.prompt_token_ids, list(data.output_token_ids), data.sampling_params,
                   data.stop_token_ids, data.seed_offset, data.is_beam, data.want_scores,
                   spec_key=data.spec_key, spec_k=data.spec_k)

    def fork(self, seq_id: int, seed_offset: int) -> SeqState:
        """Sample ``seed_offset`` of an n > 1 request: same history, its own generator (seed + offset)."""
        return SeqState(seq_id, self.prompt_token_ids, list(self.output_token_ids), self.params,
                        self.stop_token_ids, seed_offset, self.is_beam, self.want_scores,
                        spec_key=self.spec_key, spec_k=self.spec_k)

    @property
    def stop_tokens_allowed(self) -> bool:
        return len(self.output_token_ids) >= self.params.min_tokens

    @property
    def needs_processing(self) -> bool:
        """Anything beyond an argmax of the raw logits (sampling, a penalty, a stop-token ban)."""
        p = self.params
        return (not p.greedy or p.repetition_penalty != 1.0 or bool(p.logits_processors)
                or (not self.stop_tokens_allowed and bool(self.stop_token_ids)))

    def get_generator(self, device: torch.device) -> torch.Generator | None:
        if self.params.seed is None:
            return None
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.params.seed + self.seed_offset)
        return self.generator

    def seen_mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[V] bool: tokens of the prompt and output so far (updated incrementally)."""
        if self.seen is None:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = [t for t in set(self.prompt_token_ids) if 0 <= t < vocab]
            self.seen[ids] = True
        new = [t for t in self.output_token_ids[self.seen_counted :] if 0 <= t < vocab]
        if new:
            self.seen[new] = True
        self.seen_counted = len(self.output_token_ids)
        return self.seen


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def _apply_repetition_penalty(
        self, logits: torch.Tensor, states: Sequence[SeqState], extras: Sequence[list[int]] | None
    ) -> None:
        rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
        if not rows:
            return
        vocab = logits.shape[-1]
        idx = torch.tensor(rows, device=logits.device)
        masks = []
        for i in rows:
            mask = states[i].seen_mask(vocab, logits.device)
            if extras is not None and extras[i]:
                mask = mask.clone()
                mask[[t for t in extras[i] if 0 <= t < vocab]] = True
            masks.append(mask)
        seen = torch.stack(masks)
        penalty = torch.tensor([states[i].params.repetition_penalty for i in rows], device=logits.device)[:, None]
        sub = logits.index_select(0, idx)
        # HF's RepetitionPenaltyLogitsProcessor: shrink the logits of every token already seen
        penalized = torch.where(sub < 0, sub * penalty, sub / penalty)
        # an extreme penalty must not overflow a logit to inf (softmax would turn the row into NaN)
        penalized = penalized.clamp(min=torch.finfo(sub.dtype).min, max=torch.finfo(sub.dtype).max)
        logits.index_copy_(0, idx, torch.where(seen, penalized, sub))

    def process(
        self, logits: torch.Tensor, states: Sequence[SeqState], extras: Sequence[list[int]] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Each row's logits as its request samples from them: ``(processed [N, V] fp32, sampled rows)``.

        Stop tokens banned under ``min_tokens``, the repetition penalty, the request's logits processors
        (:mod:`hf_paged.sample.logits_processors`), and for sampled (non-greedy) rows temperature, top-k, top-p and
        min-p. ``extras[i]``: tokens row i sees after its state's output (the drafts before a verified position). Raises :class:`NonFiniteLogits` for NaN or +inf rows.
        """
        vocab = logits.shape[-1]
        _check_finite(logits.amax(dim=-1), states)
        bans = []
        for i, st in enumerate(states):
            produced = len(st.output_token_ids) + (len(extras[i]) if extras is not None else 0)
            if produced < st.params.min_tokens and st.stop_token_ids:
                bans.append((i, [t for t in st.stop_token_ids if t < vocab]))
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        penalized = any(s.params.repetition_penalty != 1.0 for s in states)
        hooked = hooked_rows(states)
        assert not (hooked and extras is not None), "requests with logits processors never speculate"
        # the caller's logits stay untouched (logprobs are computed from them); copy only what is changed
        logits = logits.float().clone() if bans or random_rows or penalized or hooked else logits.float()
        for i, banned in bans:
            logits[i, banned] = float("-inf")
        self._apply_repetition_penalty(logits, states, extras)
        if hooked:  # HF's order: custom processors after the penalties and bans, before the warpers
            apply_logits_processors(logits, states, hooked)
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            params = [states[i].params for i in random_rows]
            sub = logits.index_select(0, rows) / torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
            top_k = top_p = None
            if any(p.top_k > 0 for p in params):
                top_k = torch.tensor([min(p.top_k, vocab) for p in params], device=logits.device)
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            if top_k is not None or top_p is not None:
                sub = apply_top_k_top_p(sub, top_k, top_p)
            if any(p.min_p > 0 for p in params):
                sub = apply_min_p(sub, torch.tensor([p.min_p for p in params], device=logits.device))
            logits.index_copy_(0, rows, sub)
        return logits, random_rows

    def exponential_noise(self, states: Sequence[SeqState], vocab: int, device) -> torch.Tensor:
        """``[N, V]`` Exp(1) noise, each seeded row from its own generator (one fixed-size draw per token)."""
        noise = torch.empty(len(states), vocab, device=device)
        unseeded = []
        for j, st in enumerate(states):
            gen = st.get_generator(device)
            if gen is None:
                unseeded.append(j)
            else:
                noise[j].uniform_(generator=gen)
        if unseeded:
            idx = torch.tensor(unseeded, device=device)
            noise.index_copy_(0, idx, torch.empty(len(unseeded), vocab, device=device).uniform_(generator=self.generator))
        return uniform_to_exponential_(noise)

    def sample(
        self, logits: torch.Tensor, states: Sequence[SeqState], scores: dict[int, torch.Tensor] | None = None
    ) -> list[int]:
        """Pick one token per row of ``logits [N, V]`` for ``states[i]``.

        Rows of states that want HF's ``output_scores`` leave their processed logits in ``scores``.
        """
        if not any(s.needs_processing for s in states):  # plain greedy: one pass gives the check and the tokens
            values, tokens = greedy_max(logits)
            _check_finite(values, states)
            if scores is not None and any(s.want_scores for s in states):  # the fp32 copy only when kept
                _capture_scores(logits.float(), states, range(len(states)), scores)
            return tokens.tolist()
        processed, random_rows = self.process(logits, states)
        _capture_scores(processed, states, range(len(states)), scores)
        tokens = processed.argmax(dim=-1)
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = processed.index_select(0, rows).softmax(dim=-1)
            noise = self.exponential_noise([states[i] for i in random_rows], processed.shape[-1], logits.device)
            tokens.index_copy_(0, rows, (probs / noise).argmax(dim=-1))
        return tokens.tolist()


def greedy_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.max(dim=-1)``: on CPU fp32/bf16 rows one native pass (first index of each row's maximum, NaN
    propagated, the same answer; torch's bf16 reduction took ~0.75 ms for 64 x 49152 on a Zen 5 host)."""
    if (
        logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.stride(-1) == 1 and fused_ops.argmax_available(logits.dtype)
    ):
        return fused_ops.argmax_rows(logits)
    return logits.max(dim=-1)


def uniform_to_exponential_(u: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise from uniform ``u`` in [0, 1), in place: ``-log(1 - u)``, kept above zero so that
    ``p / E`` stays finite and a zero-probability token can never win the race.

    On CPU ``uniform_`` + ``log`` is ~6x faster than ``exponential_`` (64 x 49152 draws: 10 ms against 59 ms
    on a Zen 4 host), which made random sampling a quarter of a 64-sequence decode step.
    """
    return u.neg_().log1p_().neg_().clamp_min_(torch.finfo(u.dtype).tiny)


def _check_finite(row_max: torch.Tensor, states: Sequence[SeqState]) -> None:
    """Rows whose maximum is NaN (max propagates NaN), +inf, or -inf (every token masked) are garbage. Checked on
    the values as Python floats: at batch 1 on a Zen 3 the two torch ops took ~0.13 ms a step (their dispatch
    cold after the weights streamed through the caches), the list a few microseconds."""
    bad = [i for i, value in enumerate(row_max.tolist()) if not math.isfinite(value)]
    if bad:
        raise NonFiniteLogits(sorted({states[i].seq_id for i in bad}))


def _capture_scores(
    processed: torch.Tensor, states: Sequence[SeqState], rows: Iterable[int], scores: dict[int, torch.Tensor] | None
) -> None:
    """Keep the processed logits row of sequences that asked for them (HF ``output_scores``)."""
    if scores is None:
        return
    for i in rows:
        if states[i].want_scores:
            scores[states[i].seq_id] = [processed[i].clone()]
