"""Who waits ahead of whom in the queue's ordering, and why: the head's standing, and when the
longest-waiting request is not the head, that one's and those admitted before it. Read from the
real queue (the explain copy holds only its head), without changing it."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice, takewhile

from scheduler_svc.request_queue import RequestQueue
from scheduler_svc.sequence import Sequence

AHEAD_SHOWN = 5  # of the requests ahead of the oldest, the first few


@dataclass(frozen=True, slots=True)
class Standing:
    request_id: str
    wait_s: float
    standing: dict[str, str]


@dataclass(frozen=True, slots=True)
class OrderView:
    policy: str
    head: Standing
    oldest: Standing | None = None  # None: the oldest is the head
    ahead: list[Standing] = field(default_factory=list)


def order_view(queue: RequestQueue, now: float) -> OrderView | None:
    """The ordering as it stands (None when nobody waits)."""
    if not queue:
        return None

    def of(seq: Sequence) -> Standing:
        return Standing(seq.request_id, max(0.0, now - seq.arrival), queue.standing(seq))

    head, oldest = queue.peek(), queue.oldest()
    if oldest is None or oldest is head:
        return OrderView(queue.policy.value, of(head))
    ahead = islice(takewhile(lambda s: s is not oldest, queue), AHEAD_SHOWN)
    return OrderView(queue.policy.value, of(head), of(oldest), [of(s) for s in ahead])
