"""The waiting queue's type, which every ordering implements (vLLM v1's `RequestQueue` is the
model), and the arrival index the orderings other than FCFS keep for their longest waiter.

The core admits from the queue's head (`peek`, `pop`), puts a preempted request back
(`prepend`: in front, or where its ordering ranks it), takes out one that is cancelled while it
waits (`remove`), and iterates it in the order it admits. What an ordering adds, the core asks
through the same type: the service each tenant got (`charge`), which running request a waiting
head may preempt (`victim`), how it ranks the running ones (`running_key`), and what explain shows
of a request's standing (`standing`)."""

from __future__ import annotations

import heapq
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Iterator
from typing import ClassVar

from scheduler_svc.config import QueuePolicy
from scheduler_svc.reasons import StallReason
from scheduler_svc.sequence import Sequence

Clock = Callable[[], float]


class RequestQueue(ABC):
    """The requests waiting to be admitted, in the order the core admits them."""

    policy: ClassVar[QueuePolicy]
    # why the longest-waiting request is held behind the head (None: FCFS, where it is the head)
    order_reason: ClassVar[StallReason | None] = None
    charges: ClassVar[bool] = False  # it orders by the service tenants got: charge() each step
    ranks_running: ClassVar[bool] = False  # a worker's running list kept in running_key order

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        # a request's predicted seconds from admission to its first token (the core sets it)
        self.eta: Callable[[Sequence], float] = _no_time

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """A new request joins, where its ordering puts it."""

    @abstractmethod
    def peek(self) -> Sequence:
        """The head: the request admitted next (IndexError when empty)."""

    @abstractmethod
    def pop(self) -> Sequence:
        """Take the head out (it is admitted)."""

    @abstractmethod
    def prepend(self, seq: Sequence) -> None:
        """A preempted request comes back: in front of every waiting one unless the ordering
        ranks it (priority: by its priority and arrival)."""

    @abstractmethod
    def remove(self, seq: Sequence) -> None:
        """Take a waiting request out (cancelled, or failed while it waits); ValueError if it
        does not wait here."""

    @abstractmethod
    def __iter__(self) -> Iterator[Sequence]:
        """The waiting requests in admission order as it stands now, the head first."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0

    @abstractmethod
    def oldest(self) -> Sequence | None:
        """The longest-waiting request (None when empty)."""

    def oldest_arrival(self) -> float | None:
        """When the longest-waiting request arrived (None when empty)."""
        oldest = self.oldest()
        return None if oldest is None else oldest.arrival

    def emptied(self) -> RequestQueue:
        """A new empty queue of the same ordering and clock (explain's copy holds its head)."""
        twin = type(self)(self.clock)
        twin.eta = self.eta
        return twin

    def learn(self, seq: Sequence) -> None:
        """`seq` runs but never waited here (the ordering changed live while it ran): what the
        ordering keeps of a request's tenant (fair: its weight), it takes from it now."""
        return None

    def charge(self, tenant: str, prefill: int, decode: int) -> None:
        """`tenant`'s requests were given `prefill` prompt and `decode` sampled tokens (the
        orderings that do not count service ignore it)."""
        return None

    def victim(self, head: Sequence, running: list[Sequence], slots: int) -> Sequence | None:
        """The running request (of one worker, with `slots` running places) that `head` may
        preempt when it cannot be admitted there, or None (FCFS preempts nobody for a head)."""
        return None

    def victim_order(self) -> tuple:
        """What, beside who runs, `victim`'s answer depends on: while it and the running
        requests stay the same, a head that found nobody finds nobody (nothing here)."""
        return ()

    def outranks(self, head: Sequence, seq: Sequence) -> bool:
        """Does `head` (waiting) come before `seq` (running, its prompt not all computed) in this
        ordering? Then `seq`'s prompt chunk leaves the head its first chunk of the step's token
        budget (FCFS: never; the running came first)."""
        return False

    def running_key(self, seq: Sequence) -> tuple:
        """A running request's rank on its worker when `ranks_running` (the last is preempted
        first when KV runs out)."""
        return ()

    def standing(self, seq: Sequence) -> dict[str, str]:
        """What orders `seq` here, as explain names it."""
        t = seq.tenancy
        shown = {"tenant": t.tenant, "priority": str(t.priority)}
        if t.slo_class:
            shown["slo_class"] = t.slo_class
        return shown


def _no_time(seq: Sequence) -> float:
    return 0.0


def evictable(seq: Sequence) -> bool:
    """Worth preempting: running with work to come (not one whose last token is in flight)."""
    return seq.num_planned < seq.max_planned


class ArrivalIndex:
    """The longest-waiting member of a queue in O(log n): a heap of arrivals, its entries for
    requests that no longer wait dropped when they reach the top."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Sequence]] = []
        self._n = itertools.count()

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.arrival, next(self._n), seq))

    def oldest(self, members: Container[Sequence]) -> Sequence | None:
        heap = self._heap
        while heap and heap[0][2] not in members:
            heapq.heappop(heap)
        return heap[0][2] if heap else None
