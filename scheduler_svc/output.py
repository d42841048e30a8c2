"""What the core hands out besides steps: per-request events, snapshots, refusals."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.sequence import Finish, Sequence


@dataclass(slots=True)
class Event:
    request_id: str
    token_id: int | None = None
    admitted: bool = False
    queue_time: float = 0.0
    finish: Finish | None = None
    error: str = ""
    preemptions: int = 0


@dataclass(slots=True)
class StepTokens:
    """The tokens a step's decodes produced, as one event (one per token costs the step loop
    a tuple each): request i got tokens[i], except the requests in `dropped` (moved, finished
    or preempted since the step was planned)."""

    seqs: list[Sequence]
    tokens: list[int]
    dropped: set[Sequence] | None = None

    def __iter__(self):
        dropped = self.dropped
        for seq, token in zip(self.seqs, self.tokens, strict=True):
            if dropped is None or seq not in dropped:
                yield seq.request_id, token


@dataclass(slots=True)
class WorkerKv:
    name: str
    capacity: int
    written: int
    reserved_unwritten: int
    free: int
    running: int
    healthy: bool
    draining: bool = False
    block_size: int = 1
    max_context: int = 0
    steps: int = 0
    stalls: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Snapshot:
    waiting: int
    waiting_tokens: int
    running: int
    workers: list[WorkerKv]
    stalls: dict[str, int]
    head_wait_reason: str
    steps: int
    admitted: int
    finished: int
    preemptions: int
    refused: dict[str, int]
    oldest_wait: float


class Refused(Exception):
    """A request that can never run; `reason` is a bounded label, the message says what to do."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
