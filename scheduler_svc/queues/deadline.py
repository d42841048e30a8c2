"""Deadline ordering: the earliest time-to-first-token deadline that can still be met first
(each request's deadline is its arrival plus its SLO class's TTFT target). A request that can no
longer make its deadline (it has passed, or less time is left than its prompt is predicted to
take, `eta`) goes behind every one that still can, and is still served, in deadline order.
Requests without a TTFT target come after those with one that can make it and before those that
cannot. A preempted request (its first token given already) goes back in front."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Iterator

from scheduler_svc.config import QueuePolicy
from scheduler_svc.queues.base import ArrivalIndex, Clock, RequestQueue
from scheduler_svc.reasons import StallReason
from scheduler_svc.sequence import Sequence

# an entry: [deadline, arrival, n, seq, alive, eta]; n is unique, so seq is never compared
DEADLINE, SEQ, ALIVE, ETA = 0, 3, 4, 5


class DeadlineRequestQueue(RequestQueue):
    """Preempted requests in front; then a heap of those that can still make their deadline;
    then a heap of those that missed it (moved there as the clock passes their deadline)."""

    policy = QueuePolicy.DEADLINE
    order_reason = StallReason.DEADLINE

    def __init__(self, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        self._front: deque[Sequence] = deque()
        self._hopeful: list[list] = []
        self._late: list[list] = []
        self._entries: dict[Sequence, list | None] = {}  # None: in front
        self._n = itertools.count()
        self._arrivals = ArrivalIndex()

    def add(self, seq: Sequence) -> None:
        deadline = seq.tenancy.deadline(seq.arrival)
        entry = [deadline, seq.arrival, next(self._n), seq, True, 0.0]
        if deadline != math.inf:
            entry[ETA] = self.eta(seq)
        heapq.heappush(self._hopeful, entry)
        self._entries[seq] = entry
        self._arrivals.add(seq)

    def prepend(self, seq: Sequence) -> None:
        self._front.appendleft(seq)
        self._entries[seq] = None
        self._arrivals.add(seq)

    def _settle(self) -> None:
        """Drop cancelled entries at the tops; move behind those that can no longer make it."""
        now, hopeful, late = self.clock(), self._hopeful, self._late
        while hopeful and (not hopeful[0][ALIVE] or hopeful[0][DEADLINE] - hopeful[0][ETA] < now):
            entry = heapq.heappop(hopeful)
            if entry[ALIVE]:
                heapq.heappush(late, entry)
        while late and not late[0][ALIVE]:
            heapq.heappop(late)

    def _heap(self) -> list[list]:
        self._settle()
        if self._hopeful:
            return self._hopeful
        if self._late:
            return self._late
        raise IndexError("the queue is empty")

    def peek(self) -> Sequence:
        if self._front:
            return self._front[0]
        return self._heap()[0][SEQ]

    def pop(self) -> Sequence:
        if self._front:
            seq = self._front.popleft()
        else:
            seq = heapq.heappop(self._heap())[SEQ]
        del self._entries[seq]
        return seq

    def remove(self, seq: Sequence) -> None:
        if seq not in self._entries:
            raise ValueError(f"{seq.request_id} is not waiting")
        entry = self._entries.pop(seq)
        if entry is None:
            self._front.remove(seq)
        else:
            entry[ALIVE] = False

    def __iter__(self) -> Iterator[Sequence]:
        """The order pops would take now: a hopeful entry deeper in its heap that can no longer
        make its deadline is listed with the late ones, as it will be popped."""
        self._settle()
        now = self.clock()
        hopeful, late = [], [e for e in self._late if e[ALIVE]]
        for e in self._hopeful:
            if e[ALIVE]:
                (late if e[DEADLINE] - e[ETA] < now else hopeful).append(e)
        yield from self._front
        for entries in (hopeful, late):
            yield from (e[SEQ] for e in sorted(entries))

    def __len__(self) -> int:
        return len(self._entries)

    def oldest(self) -> Sequence | None:
        return self._arrivals.oldest(self._entries)

    def outranks(self, head: Sequence, seq: Sequence) -> bool:
        return head.tenancy.deadline(head.arrival) < seq.tenancy.deadline(seq.arrival)

    def standing(self, seq: Sequence) -> dict[str, str]:
        shown = super().standing(seq)
        deadline = seq.tenancy.deadline(seq.arrival)
        if math.isfinite(deadline):
            left = deadline - self.clock()
            shown["deadline_s"] = f"{left:+.3f}"  # seconds left (negative: missed)
        return shown
