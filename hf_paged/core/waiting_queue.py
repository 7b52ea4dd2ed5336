"""The waiting queue of the scheduler (pure Python): arrival order, or by (priority, arrival)."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from hf_paged.core.sequence import Sequence


class WaitingQueue:
    """Requests waiting for admission: arrival order (preempted ones in front), or by (priority, arrival)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fcfs: deque[Sequence] = deque()
        self._sorted: list[tuple[tuple, Sequence]] = []

    def __len__(self) -> int:
        return len(self._fcfs) + len(self._sorted)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._fcfs) if self.policy == "fcfs" else (r for _, r in self._sorted)

    def push(self, request: Sequence, front: bool = False) -> None:
        if self.policy == "fcfs":
            self._fcfs.appendleft(request) if front else self._fcfs.append(request)
        else:
            bisect.insort(self._sorted, (request.sort_key(), request), key=lambda e: e[0])

    def remove(self, request: Sequence) -> None:
        if self.policy == "fcfs":
            self._fcfs.remove(request)
        else:
            self._sorted = [e for e in self._sorted if e[1] is not request]
