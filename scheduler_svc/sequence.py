"""The state of one request as the scheduler sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Finish(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(slots=True, eq=False)  # identity: list.remove() must not compare every field
class Sequence:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    eos_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    sampling: Any = None  # passed through to the worker untouched
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # positions whose KV is written
    status: SeqStatus = SeqStatus.WAITING
    finish: Finish | None = None
    error: str = ""
    worker: int | None = None
    admitted_at: float | None = None  # first admission (queue time ends)
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not written yet: the whole prompt at first, 1 in decode."""
        return self.num_tokens - self.num_computed

    def max_length(self, max_context: int) -> int:
        """The most positions this request can ever hold: what `reserve` sets aside."""
        return min(len(self.prompt_ids) + self.max_tokens, max_context)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
