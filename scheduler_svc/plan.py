"""What the core hands out: per-worker batches, per-request events, and snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.sequence import Finish, Sequence


@dataclass(slots=True)
class Work:
    """One request's share of an execution: `num_tokens` tokens from position `start`."""

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool  # the chunk reaches the end of the known tokens: a new token comes out
    block_table: list[int] = field(default_factory=list)  # blocks for positions 0..start+n-1

    @property
    def token_ids(self) -> list[int]:
        prompt, end = self.seq.prompt_ids, self.start + self.num_tokens
        if self.start >= len(prompt):  # decode: only output tokens, no list concatenation
            return self.seq.output_ids[self.start - len(prompt) : end - len(prompt)]
        return self.seq.tokens[self.start : end]


@dataclass(slots=True)
class WorkerBatch:
    worker: int
    items: list[Work] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # freed since the last execution

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.items)


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
class WorkerKv:
    name: str
    capacity: int
    written: int
    reserved_unwritten: int
    free: int
    running: int
    healthy: bool
    draining: bool = False


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
