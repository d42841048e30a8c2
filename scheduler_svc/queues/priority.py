"""vLLM's priority ordering: the lowest priority value first, ties by arrival; a head that cannot
be admitted preempts the lowest-priority running request (the newest of that priority). A
preempted request goes back in front of the requests of its priority, the last preempted first,
as FCFS puts it in front: by its arrival instead, the longest-running of those preempted (the
largest context) would come back first and, as the newest admitted, be the next to go when KV
runs short again, recomputing its whole context each time."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Iterator

from scheduler_svc.config import QueuePolicy
from scheduler_svc.queues.base import ArrivalIndex, Clock, RequestQueue, evictable
from scheduler_svc.reasons import StallReason
from scheduler_svc.sequence import Sequence

# an entry: [priority, arrival, n, seq, alive]; n is unique, so seq is never compared
SEQ, ALIVE = 3, 4


class PriorityRequestQueue(RequestQueue):
    """A heap by (priority, arrival); cancelled entries are dropped when they reach the top."""

    policy = QueuePolicy.PRIORITY
    order_reason = StallReason.PRIORITY
    ranks_running = True

    def __init__(self, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        self._heap: list[list] = []
        self._entries: dict[Sequence, list] = {}
        self._n = itertools.count()
        self._arrivals = ArrivalIndex()

    def add(self, seq: Sequence) -> None:
        self._push([seq.tenancy.priority, seq.arrival, next(self._n), seq, True])

    def prepend(self, seq: Sequence) -> None:
        self._push([seq.tenancy.priority, -math.inf, -next(self._n), seq, True])

    def _push(self, entry: list) -> None:
        heapq.heappush(self._heap, entry)
        self._entries[entry[SEQ]] = entry
        self._arrivals.add(entry[SEQ])

    def _top(self) -> list:
        heap = self._heap
        while heap and not heap[0][ALIVE]:
            heapq.heappop(heap)
        return heap[0]  # IndexError when empty

    def peek(self) -> Sequence:
        return self._top()[SEQ]

    def pop(self) -> Sequence:
        self._top()
        seq = heapq.heappop(self._heap)[SEQ]
        del self._entries[seq]
        return seq

    def remove(self, seq: Sequence) -> None:
        entry = self._entries.pop(seq, None)
        if entry is None:
            raise ValueError(f"{seq.request_id} is not waiting")
        entry[ALIVE] = False

    def __iter__(self) -> Iterator[Sequence]:
        return (e[SEQ] for e in sorted(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def oldest(self) -> Sequence | None:
        return self._arrivals.oldest(self._entries)

    def victim(self, head: Sequence, running: list[Sequence], slots: int) -> Sequence | None:
        """The last of the running list (ranked: the lowest priority, the newest) still worth
        preempting, if its priority is lower than the head's."""
        mine = head.tenancy.priority
        for seq in reversed(running):
            if seq.tenancy.priority <= mine:
                return None
            if evictable(seq):
                return seq
        return None

    def outranks(self, head: Sequence, seq: Sequence) -> bool:
        return head.tenancy.priority < seq.tenancy.priority

    def running_key(self, seq: Sequence) -> tuple:
        return (seq.tenancy.priority, seq.arrival)
