"""Plain data between the scheduler and the executor: no live sequences, no torch.

The model runner keeps its own per-sequence state, created from :class:`NewSequenceData` the first time a
sequence is scheduled and dropped when the sequence is listed in ``finished_seq_ids``; block tables arrive as
diffs (``block_ids_from``, ``new_block_ids``) into the runner's persistent copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_paged.core.kv_tiers import TierMoves
from hf_paged.sampling_params import SamplingParams


@dataclass
class NewSequenceData:
    """What the runner needs to know once about a sequence it has not seen before."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty for a forked sample or beam
    sampling_params: SamplingParams
    stop_token_ids: frozenset[int]
    seed_offset: int = 0  # sample i of an n > 1 request draws from seed + i
    is_beam: bool = False
    want_scores: bool = False  # HF output_scores: return the processed logits row of every sampled token
    spec_key: str | None = None  # which proposer drafts for it (speculative decoding), if any
    spec_k: int = 0  # its most drafts per step


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: ``token_ids`` at positions ``start .. start + len(token_ids) - 1``."""

    seq_id: int
    start: int  # tokens already in the cache (num_computed_tokens)
    token_ids: list[int]  # the tokens to run (a prefill chunk, one decode token, last token + drafts)
    new_block_ids: list[int]  # its block table from ``block_ids_from`` on (a diff: the runner keeps the table)
    sample: bool  # the step reaches the end of the known tokens, so a token is sampled
    num_draft_tokens: int = 0  # the last ones of ``token_ids`` are drafts to verify (speculative decoding)
    fork_seq_ids: list[int] = field(default_factory=list)  # n > 1: ids of the samples forked at this step
    propose: bool = False  # draft tokens for its next step (speculative decoding; the batch is small enough)
    block_ids_from: int = 0  # the runner's copy of the table is kept up to here, then ``new_block_ids`` follow
    lora_int_id: int = 0  # its LoRA adapter (0: the base model)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    new_sequences: list[NewSequenceData] = field(default_factory=list)
    num_batched_tokens: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the forward
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block), done first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    preempted_seq_ids: list[int] = field(default_factory=list)
    swapped_in_seq_ids: list[int] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # since the previous step: forget their state
    blocks_high_water: int = 0  # every block this step reads or writes has a smaller id (pages to commit first)
    tier_moves: TierMoves | None = None  # KV tiers: demotions first, promotions before the forward, saves after

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class BeamUpdate:
    """A beam search's choice after a step, applied by ``Scheduler.update`` (the search never touches the
    scheduler): each new beam continues a running one with one token, in place (``new_seq_id`` None: the
    parent's first continuation) or as a fork sharing the parent's blocks; beams nobody continues are freed.
    A finished search frees all its beams."""

    continues: list[tuple[int, int, int | None, int]] = field(default_factory=list)  # (parent, token, new id, index)
    frees: list[int] = field(default_factory=list)


@dataclass
class SampledLogprobs:
    """Log-probabilities (of the model's raw distribution) for one sampled token."""

    token_logprob: float
    top: dict[int, float]  # the ``logprobs`` most likely tokens


@dataclass
class ModelRunnerOutput:
    """What one step produced, per sequence id.

    ``sampled_token_ids[s]`` holds one token, or with speculative decoding the accepted drafts plus one.
    Beams get no sampled token: their processed log-prob rows are in ``beam_rows`` (torch tensors, read by
    the engine's beam search, never by the scheduler).
    """

    sampled_token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[SampledLogprobs]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # sequences whose sampling failed: finish with "error"
    beam_rows: dict[int, object] = field(default_factory=dict)
    num_draft_tokens: dict[int, int] = field(default_factory=dict)  # drafts verified, per sequence
    num_accepted_tokens: dict[int, int] = field(default_factory=dict)  # of those, accepted
    scores: dict[int, object] = field(default_factory=dict)  # HF output_scores: processed logits rows (torch)
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)  # drafts to verify next step
    stopped: set[int] = field(default_factory=set)  # sequences a stopping criterion ended at this step's token
