"""The waiting queue as a type: one class per ordering (vLLM v1's `RequestQueue` is the model).

The core admits from the queue's head (`peek`, `pop`), puts a preempted request back in front
of everything (`prepend`: it is recomputed before anyone behind it starts), takes out one that
is cancelled while it waits (`remove`), and iterates it in the order it admits. It never knows
which ordering it holds: a new policy is a new class here and a name in `QueuePolicy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from scheduler_svc.config import QueuePolicy
from scheduler_svc.sequence import Sequence


class RequestQueue(ABC):
    """The requests waiting to be admitted, in the order the core admits them."""

    policy: QueuePolicy

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
        """A preempted request goes back in front of every waiting one."""

    @abstractmethod
    def remove(self, seq: Sequence) -> None:
        """Take a waiting request out (cancelled, or failed while it waits)."""

    @abstractmethod
    def __iter__(self) -> Iterator[Sequence]:
        """The waiting requests in admission order, the head first."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0

    def oldest_arrival(self) -> float | None:
        """When the longest-waiting request arrived (None when empty)."""
        return min((s.arrival for s in self), default=None)

    def emptied(self) -> RequestQueue:
        """A new empty queue of the same ordering (a copy of the core holds only its head)."""
        return create_request_queue(self.policy)


class FCFSRequestQueue(RequestQueue):
    """First come, first served: a deque in arrival order, preempted requests in front."""

    policy = QueuePolicy.FCFS

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._queue.append(seq)

    def peek(self) -> Sequence:
        return self._queue[0]

    def pop(self) -> Sequence:
        return self._queue.popleft()

    def prepend(self, seq: Sequence) -> None:
        self._queue.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def oldest_arrival(self) -> float | None:
        """The head: it arrived first (a preempted request, back in front, arrived before
        everyone admitted after it)."""
        return self._queue[0].arrival if self._queue else None


QUEUES: dict[QueuePolicy, type[RequestQueue]] = {QueuePolicy.FCFS: FCFSRequestQueue}


def create_request_queue(policy: QueuePolicy | str = QueuePolicy.FCFS) -> RequestQueue:
    """An empty queue of `policy` (ValueError naming the known ones for an unknown name)."""
    try:
        return QUEUES[QueuePolicy(policy)]()
    except ValueError:
        known = ", ".join(p.value for p in QueuePolicy)
        raise ValueError(f"unknown queue policy {policy!r}; known: {known}") from None
