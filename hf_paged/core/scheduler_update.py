"""The scheduler's half after a step (pure Python): apply what the step produced to the sequences.

:class:`SchedulerUpdate` is the part of :class:`~hf_paged.core.scheduler.Scheduler` that runs after the forward:
computed counts, forks of ``n > 1`` samples, appended tokens and their stop checks, speculative acceptance,
prefix-cache hashing, and the beam searches' choices (:class:`~hf_paged.core.scheduler_output.BeamUpdate`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from hf_paged.core.scheduler_output import BeamUpdate, ModelRunnerOutput, SchedulerOutput
from hf_paged.core.sequence import Sequence, SequenceStatus


class SchedulerUpdate:
    """After-the-step methods of the scheduler (a mixin: the state lives in ``Scheduler``)."""

    def update(
        self, out: SchedulerOutput, result: ModelRunnerOutput, beams: Iterable[BeamUpdate] = ()
    ) -> list[Sequence]:
        """Advance computed tokens, fork samples, append sampled tokens, finish what stopped or failed; then
        apply the beam searches' choices (``beams``, made from this step's log-prob rows).

        Returns the sequences that received tokens, forked, or finished this step (beams are not reported).
        """
        now = time.time()
        self.kv.commit_table_diffs(item.seq_id for item in out.scheduled)  # the step ran: its diffs are applied
        changed: list[Sequence] = []
        for item in out.scheduled:
            request = self.sequences.get(item.seq_id)
            if request is None or request.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            tokens = result.sampled_token_ids.get(item.seq_id)
            if item.num_draft_tokens:
                # verified: the last token and the accepted drafts hold KV; rejected drafts roll back
                accepted = len(tokens) - 1 if tokens else 0
                request.num_computed_tokens = item.start + 1 + accepted
                # blocks past the next token's slot hold rejected drafts only: back to the pool
                self.kv.truncate(request.seq_id, request.num_computed_tokens + 1)
                self._count_acceptance(item.num_draft_tokens, accepted, request)
            else:
                request.num_computed_tokens = item.seq_len
            request.spec_token_ids = []
            if item.fork_seq_ids and not request.forked:
                request.forked = True
                for index, child_id in enumerate(item.fork_seq_ids, start=1):
                    child = self.fork_sequence(request, index, child_id)
                    self._known.add(child_id)  # the runner made its state when it sampled for it
                    child_tokens = result.sampled_token_ids.get(child_id)
                    if child_tokens:
                        self.append_tokens(child, child_tokens, result, now)
                    else:
                        child.error = result.errors.get(child_id, "no token was sampled for this sample")
                        self.finish_request(child_id, SequenceStatus.FINISHED_ERROR)
                    changed.append(child)
            error = result.errors.get(item.seq_id)
            if error is not None:
                request.error = error
                self.finish_request(request.seq_id, SequenceStatus.FINISHED_ERROR)
                changed.append(request)
                continue
            if tokens:
                self.append_tokens(request, tokens, result, now)
                changed.append(request)
            if request.status is SequenceStatus.RUNNING:
                # only verified tokens are hashed: num_computed counts none of the rejected drafts
                self.kv.cache_blocks(request.seq_id, request, request.num_computed_tokens)
                request.spec_token_ids = result.spec_token_ids.get(item.seq_id, [])
        for beam in beams:
            self._apply_beams(beam)
        return changed

    def _apply_beams(self, update: BeamUpdate) -> None:
        """Forks first (a fork copies its parent before the parent's own new token), then frees, then tokens."""
        for parent, _, child, index in update.continues:
            if child is not None:
                self.fork_sequence(self.sequences[parent], index, child)
        for seq_id in update.frees:
            self.abort_request(seq_id)
        for parent, token, child, _ in update.continues:
            beam = self.sequences[parent if child is None else child]
            self.append_tokens(beam, [token])
            if beam.status is SequenceStatus.FINISHED_LENGTH:
                raise RuntimeError(f"beam {beam.seq_id} was finished by the scheduler (a bug: please report)")

    def _count_acceptance(self, num_drafts: int, accepted: int, request: Sequence) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += accepted
        counts = request.spec_counts
        counts[0] += 1
        counts[1] += num_drafts
        counts[2] += accepted
        for per_position in (self.spec_accepted_per_position, request.spec_accepted_per_position):
            while len(per_position) < num_drafts:
                per_position.append(0)
            for i in range(accepted):
                per_position[i] += 1

    # -- sequences of a group (n > 1, beams) ------------------------------------------------------------
    def fork_sequence(self, parent: Sequence, index: int, seq_id: int | None = None) -> Sequence:
        """A sibling of ``parent`` sharing its blocks (copy-on-write), behind it in scheduling order."""
        child = parent.fork(self.next_seq_id() if seq_id is None else seq_id, index)
        self.sequences[child.seq_id] = child
        if parent.seq_id in self.kv.tables:
            self.kv.fork(parent.seq_id, child.seq_id)
            child.status = SequenceStatus.RUNNING
            self._insert_running(child)
        else:  # the parent was preempted (its KV dropped or on the host): the child recomputes its own
            child.num_computed_tokens = 0
            child.status = SequenceStatus.PREEMPTED
            self.waiting.push(child, front=True)
        return child

    def append_tokens(
        self, request: Sequence, tokens: list[int], result: ModelRunnerOutput | None = None, now: float | None = None
    ) -> None:
        """Append tokens one by one, stopping (and finishing the sequence) at the first that ends it."""
        logprobs = result.logprobs.get(request.seq_id) if result is not None else None
        request.parked = False  # a new token to compute
        for k, token in enumerate(tokens):
            if logprobs is not None and k < len(logprobs):
                request.cumulative_logprob += logprobs[k].token_logprob
                if request.logprobs is not None:
                    request.logprobs.append({token: logprobs[k].token_logprob, **logprobs[k].top})
            status = request.append_output_token(token, now)
            self.num_generated_tokens += 1
            if status is not None:
                # a stop inside an accepted burst drops the drafts after it: their KV is not the sequence's
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                self._remove_from_queue(request)
                self._finish(request, status, now)
                return
        if result is not None and request.seq_id in result.stopped:  # a stopping criterion (no speculation)
            self._remove_from_queue(request)
            self._finish(request, SequenceStatus.FINISHED_STOPPED, now)
