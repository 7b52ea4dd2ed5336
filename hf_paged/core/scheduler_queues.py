"""Moving sequences between the scheduler's queues (pure Python): preemption, finishing, the consistency check.

:class:`SchedulerQueues` is the part of :class:`~hf_paged.core.scheduler.Scheduler` that moves a sequence from one
queue to another: running in scheduling order, preempted by recompute (its blocks freed, back to the front of the
waiting queue) or by swap (its blocks copied to host memory), parked while a beam waits for its siblings, and
finished (its full blocks kept as a cached prefix, its blocks freed).
"""

from __future__ import annotations

import bisect
import time

from hf_paged.core.scheduler_output import SchedulerOutput
from hf_paged.core.sequence import Sequence, SequenceStatus


class SchedulerQueues:
    """Queue moves of the scheduler (a mixin: the state lives in ``Scheduler``)."""

    def _preempt_idle(self, out: SchedulerOutput) -> bool:
        """Preempt every running sequence with nothing to compute (a beam waiting for its siblings' rows);
        True if there was one. Its row is kept by the beam search; it comes back when it has a new token."""
        idle = [r for r in self.running if r.num_computed_tokens == r.num_tokens]
        for request in reversed(idle):
            self._preempt(request, out)
            request.parked = True  # nothing to run until its search appends a token
        return bool(idle)

    def _preempt(self, request: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(request)
        request.num_preemptions += 1
        out.preempted_seq_ids.append(request.seq_id)
        if self._preemption_mode(request) == "swap" and self.kv.can_swap_out(request.seq_id):
            out.swap_out.extend(self.kv.swap_out(request.seq_id))
            request.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, request, key=Sequence.sort_key)
            self.num_preemptions["swap"] += 1
            return
        self.kv.free(request.seq_id)
        request.num_computed_tokens = 0
        request.status = SequenceStatus.PREEMPTED
        self.waiting.push(request, front=True)
        self.num_preemptions["recompute"] += 1

    def _preemption_mode(self, request: Sequence) -> str:
        if self.preemption_mode == "auto":
            grouped = request.sampling_params.n > 1 or request.is_beam
            return "swap" if grouped else "recompute"
        return self.preemption_mode

    def _insert_running(self, request: Sequence) -> None:
        if self.policy == "fcfs":
            self.running.append(request)
        else:
            bisect.insort(self.running, request, key=Sequence.sort_key)

    def _remove_from_queue(self, request: Sequence) -> None:
        if request.status is SequenceStatus.RUNNING:
            self.running.remove(request)
        elif request.status is SequenceStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)

    def _finish(self, request: Sequence, status: SequenceStatus, now: float | None = None) -> None:
        if request.seq_id in self.kv.tables:  # its last full blocks stay reusable as a cached prefix
            self.kv.cache_blocks(request.seq_id, request, request.num_computed_tokens)
        self.kv.free(request.seq_id)
        request.status = status
        request.finish_time = time.time() if now is None else now
        del self.sequences[request.seq_id]
        if request.seq_id in self._known:
            self._known.discard(request.seq_id)
            self._finished_since_schedule.append(request.seq_id)

    def check_consistency(self) -> None:
        """Assert the block accounting and the queues agree (for tests)."""
        self.kv.check_consistency()
        running = {r.seq_id for r in self.running}
        swapped = {r.seq_id for r in self.swapped}
        waiting = {r.seq_id for r in self.waiting}
        assert len(running) + len(swapped) + len(waiting) == len(self.sequences), "a sequence is queued twice"
        assert running | swapped | waiting == set(self.sequences), "queued sequences differ from the live ones"
        assert set(self.kv.tables) <= running, "a sequence holds device blocks while not running"
        assert set(self.kv.host_tables) == swapped, "swapped sequences and host tables differ"
        for r in self.running:
            assert r.status is SequenceStatus.RUNNING and r.num_computed_tokens <= r.num_tokens, r
        for r in self.waiting:
            assert r.num_computed_tokens == 0 and r.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED), r
