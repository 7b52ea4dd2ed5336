"""Continuous batching: which tokens of which sequence run this step (pure Python).

One rule drives everything: bring each sequence's ``num_computed_tokens`` up to its ``num_tokens``. Each
step, in order and under a token budget and a sequence cap:

1. running sequences (a decode token, or the next prompt chunk), in scheduling order; when blocks run out
   the last one in that order is preempted (recompute: its blocks are freed and it is prefilled again
   later; swap: its blocks are copied to host memory);
2. swapped-out sequences, brought back when their blocks fit;
3. waiting requests, in order, starting after their longest cached prefix, long prompts in chunks.

While a sequence is decoding, no other sequence gets a prefill chunk (prompt, or a recompute) longer than
``long_prefill_token_threshold`` tokens in a step, so a long prompt that arrives is spread over several
steps and the running streams' inter-token latency stays bounded (vLLM's key of the same name). With
``max_itl_ratio``, that cap is also held to what the measured step times say fits that multiple of a
decode-only step (:mod:`hf_paged.core.prefill_pacer`).

Scheduling order is arrival (``scheduling_policy="fcfs"``) or ``(priority, arrival)`` with lower values
first (``"priority"``, vLLM's convention); the victim of a preemption is always the last in that order.

The moves between the queues (preemption, finishing) live in :mod:`hf_paged.core.scheduler_queues`, and what
happens after the forward in :mod:`hf_paged.core.scheduler_update`; both are mixins of :class:`Scheduler`.
"""

from __future__ import annotations

import itertools

from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.prefill_pacer import PrefillPacer, check_max_itl_ratio
from hf_paged.core.spec_gate import SpecGate
from hf_paged.core.scheduler_output import ModelRunnerOutput, NewSequenceData, ScheduledSequence, SchedulerOutput
from hf_paged.core.scheduler_queues import SchedulerQueues
from hf_paged.core.scheduler_update import SchedulerUpdate
from hf_paged.core.waiting_queue import WaitingQueue
from hf_paged.core.sequence import Sequence, SequenceStatus

SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap", "auto")


def check_long_prefill_token_threshold(value: object) -> int:
    """``long_prefill_token_threshold`` as an int (0: off): a positive int, or None or 0 for off."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"long_prefill_token_threshold must be a positive int, or None or 0 for no cap, got {value!r}")
    if value < 0:
        raise ValueError(f"long_prefill_token_threshold must be a positive int, or None or 0 for no cap, got {value}")
    return value


class Scheduler(SchedulerUpdate, SchedulerQueues):
    """Continuous batching over one :class:`KVCacheManager`.

    Args:
        kv_cache_manager: The block manager (with prefix caching and a host pool if those are on).
        max_num_seqs: Most sequences running at once.
        max_num_batched_tokens: Token budget of one step.
        max_model_len: Longest sequence (prompt + output).
        enable_chunked_prefill: Split prompts over steps. When off, a prompt runs whole in one step; a
            preempted sequence's recompute (prompt + output) may still span steps, or it could never resume.
        scheduling_policy: "fcfs" or "priority".
        preemption_mode: "recompute", "swap" (falls back to recompute when the host pool is full) or "auto"
            (swap the members of a group, i.e. n > 1 samples and beams, recompute single sequences).
        long_prefill_token_threshold: With chunked prefill, the longest prefill chunk one sequence gets in a
            step while another sequence is decoding. None or 0: no cap beyond the step's budget.
        max_itl_ratio: While a sequence is decoding, one sequence's prefill chunk is also held to what fits
            this multiple of a decode-only step's time, as measured by :meth:`observe_step` (at least
            ``PrefillPacer.min_chunk``). None or 0: no pacing.
        max_loras: The most distinct LoRA adapters among the running sequences (one step mixes at most these);
            a request of another adapter waits. 0: no LoRA (no limit).

    Speculative decoding is per request (``Sequence.spec_key`` and friends): a decoding sequence with drafts
    (from the runner's previous output) runs ``1 + len(drafts)`` tokens, drafts cut to the budget and dropped
    before anyone is preempted for them, and only while fewer sequences than its ``spec_disable_batch_size``
    are queued, or (``"auto"``) while the speculation gate (:mod:`hf_paged.core.spec_gate`) has measured that
    speculation pays at the running batch size; ``spec_lookahead`` slots behind it are set aside for a draft
    model's KV.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        scheduling_policy: str = "fcfs",
        preemption_mode: str = "recompute",
        long_prefill_token_threshold: int | None = None,
        max_itl_ratio: float | None = None,
        max_loras: int = 0,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        self.long_prefill_token_threshold = check_long_prefill_token_threshold(long_prefill_token_threshold)
        ratio = check_max_itl_ratio(max_itl_ratio)
        self.pacer = PrefillPacer(ratio) if ratio else None
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = scheduling_policy
        self.preemption_mode = preemption_mode
        self.waiting = WaitingQueue(scheduling_policy)
        self.running: list[Sequence] = []  # in scheduling order
        self.swapped: list[Sequence] = []  # in scheduling order
        self.sequences: dict[int, Sequence] = {}  # seq_id -> every live sequence
        self._seq_ids = itertools.count()
        self._known: set[int] = set()  # sequences the runner has state for
        self._finished_since_schedule: list[int] = []
        self._queued = 0  # sequences queued at the start of this step (speculation's batch limit)
        self.spec_gate = SpecGate()  # "auto" batch limit: speculation where measured steps say it pays
        self._spec_allowed = True  # the gate's answer for this step
        self._prefill_cap = 0  # this step's cap on one sequence's prefill chunk (0: none)
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.num_prompt_tokens = 0  # of requests admitted (first admission only)
        self.num_generated_tokens = 0
        self.spec_num_drafts = 0  # verifications
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_position: list[int] = []  # drafts accepted at position i

    # -- intake -------------------------------------------------------------------------------------
    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    def check_request(self, request: Sequence) -> None:
        """Raise ValueError if the request can never run; nothing is changed."""
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError("prompt is empty: a request needs at least one prompt token")
        if n > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, more than max_model_len={self.max_model_len}")
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {n} tokens, more than max_num_batched_tokens={self.max_num_batched_tokens} "
                "and chunked prefill is disabled"
            )
        n_samples = request.sampling_params.n
        if n_samples > self.max_num_seqs:
            raise ValueError(
                f"n={n_samples} samples exceed max_num_seqs={self.max_num_seqs}: the samples of one request run "
                "side by side; raise max_num_seqs or ask for fewer samples"
            )
        # The most slots a sequence can ever hold: it stops at max_model_len tokens, and the last
        # sampled token is never fed back.
        longest = max(min(n + request.sampling_params.max_tokens - 1, self.max_model_len), n)
        if self.kv.blocks_for_tokens(longest) > self.kv.num_blocks:
            raise ValueError(
                f"request needs up to {longest} tokens of KV, more than the whole pool "
                f"({self.kv.num_blocks} blocks x {self.kv.block_size} tokens)"
            )

    def add_request(self, request: Sequence) -> None:
        self.check_request(request)
        if request.seq_id is None:
            request.seq_id = self.next_seq_id()
        assert request.seq_id not in self.sequences, f"sequence {request.seq_id} is already live"
        request.status = SequenceStatus.WAITING
        request.max_model_len = self.max_model_len
        self.sequences[request.seq_id] = request
        self.waiting.push(request)
        if self.kv.tiers is not None:  # start reading its prefix's files now, ahead of its admission
            self.kv.tiers.read_ahead(self.kv, request)

    def abort_request(self, seq_id: int) -> Sequence | None:
        """Finish a sequence as aborted and free its blocks; None if it is unknown or already finished."""
        return self.finish_request(seq_id, SequenceStatus.FINISHED_ABORTED)

    def finish_request(self, seq_id: int, status: SequenceStatus, error: str | None = None) -> Sequence | None:
        """Finish a live sequence with ``status`` (a stop string, an error with its message, an abort) and free
        its blocks; None if it is unknown or already finished."""
        assert status.finished, f"{status} is not a finished status"
        request = self.sequences.get(seq_id)
        if request is None:
            return None
        if error is not None:
            request.error = error
        self._remove_from_queue(request)
        self._finish(request, status)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.sequences)

    @property
    def num_unfinished(self) -> int:
        return len(self.sequences)

    # -- the step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_seq_ids=self._finished_since_schedule)
        self._finished_since_schedule = []
        self._queued = len(self.running) + len(self.waiting) + len(self.swapped)
        self._spec_allowed = self.spec_gate.allows(len(self.running)) if self._uses_gate() else True
        self._prefill_cap = self._step_prefill_cap()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted_seq_ids:  # a step that had to preempt has no room to bring anyone in
            budget = self._schedule_swapped(out, budget)
            if not any(not r.parked for r in self.swapped):
                budget = self._schedule_waiting(out, budget)
        if not out.scheduled and (self.waiting or self.swapped) and self._preempt_idle(out):
            # Beams that produced their row hold blocks while a sibling cannot get in: make room.
            budget = self._schedule_swapped(out, budget)
            if not any(not r.parked for r in self.swapped):
                budget = self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        out.block_copies = self.kv.take_copies()
        out.blocks_high_water = self.kv.pool.high_water
        if self.kv.tiers is not None:  # KV tiers (core/kv_tiers.py): this step's demotions, promotions, saves
            self.kv.tiers.plan_saves(self.kv, out, self.sequences)
            out.tier_moves = self.kv.tiers.take_moves()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < self.max_num_seqs:
            request = self.running[i]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new == 0:  # a beam waiting for the beam search to pick its next token
                i += 1
                continue
            num_new = self._cap_prefill(num_new, budget)
            # drafts only on a plain decode, cut to the budget (never during prefill chunks)
            drafts = []
            if num_new == 1 and request.spec_token_ids and self._speculates(request):
                # cut to the budget, and never past max_tokens or max_model_len
                room = min(budget - 1, request.sampling_params.max_tokens - request.num_output_tokens - 1,
                           self.max_model_len - request.num_tokens)
                drafts = request.spec_token_ids[: max(0, room)]
            lookahead = self._lookahead(out, request, num_new)
            while self.kv.allocate_slots(
                request.seq_id, request.num_computed_tokens, num_new + len(drafts), num_lookahead=lookahead
            ) is None:
                if drafts or lookahead:  # the pool is short: no speculation rather than preempting anyone
                    drafts, lookahead = [], 0
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                self._schedule(out, request, num_new, drafts)
                budget -= num_new + len(drafts)
                i += 1
        return budget

    def _step_prefill_cap(self) -> int:
        """The cap on one sequence's prefill chunk this step (0: none): while a sequence is decoding (it has output
        and at most its last token, or a beam's, to compute), with chunked prefill on, the threshold and the
        pacer's cap, whichever is lower. A cap per sequence, as vLLM's threshold: prompts arriving together each
        get up to it, so a crowd of short prompts still joins the batch at once."""
        if not self.enable_chunked_prefill or not (self.long_prefill_token_threshold or self.pacer):
            return 0
        if not any(r.output_token_ids and r.num_tokens - r.num_computed_tokens <= 1 for r in self.running):
            return 0
        caps = [c for c in (self.long_prefill_token_threshold, self.pacer.cap() if self.pacer else 0) if c]
        return min(caps)

    def _cap_prefill(self, num_new: int, budget: int) -> int:
        """A sequence's tokens this step: ``num_new`` within the budget and, for a prefill chunk, the cap."""
        num_new = min(num_new, budget)
        return min(num_new, self._prefill_cap) if self._prefill_cap and num_new > 1 else num_new

    def observe_step(self, out: SchedulerOutput, seconds: float, result: ModelRunnerOutput | None = None) -> None:
        """Tell the prefill pacer (with ``max_itl_ratio``) and the speculation gate (with ``result``: the tokens
        the step gave) how long ``out`` took to run."""
        rows = [len(s.token_ids) - s.num_draft_tokens for s in out.scheduled]
        if self.pacer is not None:
            self.pacer.observe(seconds, sum(1 for n in rows if n == 1), sum(n for n in rows if n > 1))
        if result is not None and rows and all(n == 1 for n in rows) and self._uses_gate():
            # a step's seconds include drafting for the next one: only steps that verify and draft (speculation's
            # steady state) or do neither (plain decoding's) are measured, not the steps between the two
            verified, drafted = any(s.num_draft_tokens for s in out.scheduled), bool(result.spec_token_ids)
            if verified == drafted:
                tokens = sum(len(result.sampled_token_ids.get(s.seq_id, ())) for s in out.scheduled)
                self.spec_gate.observe(seconds, len(rows), tokens, verified)

    def _uses_gate(self) -> bool:
        return any(r.spec_key is not None and r.spec_disable_batch_size == "auto" for r in self.running)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while budget > 0 and len(out.scheduled) < self.max_num_seqs:
            loras = self._running_loras()
            request = next((r for r in self.swapped if not r.parked and self._lora_fits(r, loras)), None)
            if request is None:
                break
            num_new = self._cap_prefill(request.num_tokens - request.num_computed_tokens, budget)
            extra = self.kv.blocks_for_tokens(request.num_computed_tokens + num_new) - len(
                self.kv.host_tables[request.seq_id]
            )
            if not self.kv.can_swap_in(request.seq_id, max(0, extra)):
                break
            out.swap_in.extend(self.kv.swap_in(request.seq_id))
            out.swapped_in_seq_ids.append(request.seq_id)
            self.swapped.remove(request)
            request.status = SequenceStatus.RUNNING
            self._insert_running(request)
            if num_new > 0:
                allocated = self.kv.allocate_slots(request.seq_id, request.num_computed_tokens, num_new)
                assert allocated is not None  # the call stays outside the assert: python -O strips asserts
                self._schedule(out, request, num_new)
                budget -= num_new
        return budget

    def _num_active(self) -> int:
        """Running sequences with tokens to compute (idle beams wait for their search and take no slot)."""
        return sum(1 for r in self.running if r.num_computed_tokens < r.num_tokens)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        active = self._num_active()
        loras = self._running_loras()
        while budget > 0 and active < self.max_num_seqs and len(out.scheduled) < self.max_num_seqs:
            # a request of an adapter beyond max_loras waits; the requests behind it may go first
            request = next((r for r in self.waiting if not r.parked and self._lora_fits(r, loras)), None)
            if request is None:
                break
            cached, hashes = self.kv.find_cached_prefix(request)  # its block hashes are computed once
            num_computed = len(cached) * self.kv.block_size
            num_new = request.num_tokens - num_computed
            if num_new > budget and not self.enable_chunked_prefill and not request.output_token_ids:
                break  # a prompt runs whole when chunking is off (a recompute may span steps)
            num_new = self._cap_prefill(num_new, budget)
            if self.kv.allocate_slots(
                request.seq_id, num_computed, num_new, cached, hashes, self._lookahead(out, request, num_new, num_computed)
            ) is None:
                break
            self.waiting.remove(request)
            if request.num_preemptions == 0:
                self.num_prompt_tokens += request.num_prompt_tokens
                request.num_cached_tokens = num_computed
                self.kv.record_prefix_query(request.num_prompt_tokens, min(num_computed, request.num_prompt_tokens))
            request.num_computed_tokens = num_computed
            request.status = SequenceStatus.RUNNING
            self._insert_running(request)
            self._schedule(out, request, num_new)
            budget -= num_new
            active += 1
            if request.lora_int_id:
                loras.add(request.lora_int_id)
        return budget

    def _running_loras(self) -> set[int]:
        """The LoRA adapters of the running sequences (at most ``max_loras``: a step mixes only these)."""
        return {r.lora_int_id for r in self.running if r.lora_int_id} if self.max_loras else set()

    def _lora_fits(self, request: Sequence, loras: set[int]) -> bool:
        lora = request.lora_int_id
        return not lora or not self.max_loras or lora in loras or len(loras) < self.max_loras

    def _schedule(self, out: SchedulerOutput, request: Sequence, num_new: int, drafts: list[int] = ()) -> None:
        start = request.num_computed_tokens
        sample = start + num_new == request.num_tokens
        if request.seq_id not in self._known:
            self._known.add(request.seq_id)
            out.new_sequences.append(NewSequenceData(
                request.seq_id, request.prompt_token_ids, list(request.output_token_ids), request.sampling_params,
                request.stop_token_ids, request.index, request.is_beam, request.scores is not None,
                request.spec_key, request.spec_k,
            ))
        forks = []
        if sample and not request.forked:
            forks = [self.next_seq_id() for _ in range(request.sampling_params.n - 1)]
        table_from, new_block_ids = self.kv.take_table_diff(request.seq_id)
        out.scheduled.append(ScheduledSequence(
            request.seq_id, start, request.token_ids(start, start + num_new) + list(drafts),
            new_block_ids, sample, len(drafts), fork_seq_ids=forks,
            propose=sample and self._speculates(request), block_ids_from=table_from,
            lora_int_id=request.lora_int_id,
        ))

    def _speculates(self, request: Sequence) -> bool:
        limit = request.spec_disable_batch_size
        if request.spec_key is None:
            return False
        if limit == "auto":
            return self._spec_allowed
        return limit is None or self._queued < limit

    def _lookahead(self, out: SchedulerOutput, request: Sequence, num_new: int, num_computed: int | None = None) -> int:
        """Slots behind a sequence that reaches its sampling point, for a draft model's KV while it proposes."""
        start = request.num_computed_tokens if num_computed is None else num_computed
        if not request.spec_lookahead or start + num_new < request.num_tokens or not self._speculates(request):
            return 0
        return request.spec_lookahead
