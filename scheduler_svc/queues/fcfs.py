"""First come, first served: the seed's ordering."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

from scheduler_svc.config import QueuePolicy
from scheduler_svc.queues.base import Clock, RequestQueue
from scheduler_svc.sequence import Sequence


class FCFSRequestQueue(RequestQueue):
    """A deque in arrival order, preempted requests in front."""

    policy = QueuePolicy.FCFS

    def __init__(self, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        self._queue: deque[Sequence] = deque()
        # a request put back in front that arrived after the head (it was admitted out of
        # arrival order, under another ordering before a live switch): until the queue
        # empties, the oldest is looked for, not taken to be the head
        self._unordered = False

    def add(self, seq: Sequence) -> None:
        self._queue.append(seq)

    def peek(self) -> Sequence:
        return self._queue[0]

    def pop(self) -> Sequence:
        return self._queue.popleft()

    def prepend(self, seq: Sequence) -> None:
        if self._queue and seq.arrival > self._queue[0].arrival:
            self._unordered = True
        self._queue.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def oldest(self) -> Sequence | None:
        """The head: it arrived first (a preempted request, back in front, arrived before
        everyone admitted after it), unless one admitted out of arrival order came back."""
        queue = self._queue
        if not queue:
            self._unordered = False
            return None
        if self._unordered:
            return min(queue, key=lambda s: s.arrival)
        return queue[0]
