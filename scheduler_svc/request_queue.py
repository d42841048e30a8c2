"""The waiting queue as a type: one class per ordering (queues/), built by name.

The core never knows which ordering it holds: a new policy is a new class in queues/ and a name
in `QueuePolicy` (config.py)."""

from __future__ import annotations

import time

from scheduler_svc.config import QueuePolicy
from scheduler_svc.queues.base import Clock, RequestQueue
from scheduler_svc.queues.deadline import DeadlineRequestQueue
from scheduler_svc.queues.fair import FairRequestQueue
from scheduler_svc.queues.fcfs import FCFSRequestQueue
from scheduler_svc.queues.priority import PriorityRequestQueue

__all__ = [
    "QUEUES",
    "DeadlineRequestQueue",
    "FCFSRequestQueue",
    "FairRequestQueue",
    "PriorityRequestQueue",
    "QueuePolicy",
    "RequestQueue",
    "create_request_queue",
]

QUEUES: dict[QueuePolicy, type[RequestQueue]] = {
    QueuePolicy.FCFS: FCFSRequestQueue,
    QueuePolicy.PRIORITY: PriorityRequestQueue,
    QueuePolicy.FAIR: FairRequestQueue,
    QueuePolicy.DEADLINE: DeadlineRequestQueue,
}


def create_request_queue(
    policy: QueuePolicy | str = QueuePolicy.FCFS, clock: Clock = time.monotonic
) -> RequestQueue:
    """An empty queue of `policy` (ValueError naming the known ones for an unknown name)."""
    try:
        kind = QUEUES[QueuePolicy(policy)]
    except ValueError:
        known = ", ".join(p.value for p in QueuePolicy)
        raise ValueError(f"unknown queue policy {policy!r}; known: {known}") from None
    return kind(clock)
