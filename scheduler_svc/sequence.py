"""The state of one request as the scheduler sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

NO_HANDLE = -1


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
    """Counts are kept as plain fields (not properties) because the step loop reads them for
    every running request in every step.

    `num_computed` counts the positions whose KV is written once the steps already sent have run;
    `known` = prompt + output + the tokens those steps will sample, which the scheduler does not
    know yet (with overlap, one step ahead)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    eos_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    sampling: Any = None  # passed through to the worker untouched
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    known: int = 0  # set from the prompt in __post_init__
    stop_at: int = 0  # `known` at which nothing more is sampled on its worker; 0 once finished
    max_out: int = 0  # tokens it may generate on its worker (max_tokens, or less by context)
    stop_ids: frozenset[int] = frozenset()  # tokens that end it: eos_ids unless ignore_eos
    held: int = 0  # positions its allocated blocks cover
    status: SeqStatus = SeqStatus.WAITING
    finish: Finish | None = None
    error: str = ""
    worker: int | None = None
    handle: int = NO_HANDLE  # its id on the worker's step stream; changes with every placement
    admitted_at: float | None = None  # first admission (queue time ends)
    preemptions: int = 0
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of full blocks
    key_block_size: int = 0  # the block size `block_keys` are for
    cache_salt: bytes = b""  # seeds `block_keys`: only requests of equal salt share blocks
    suspect: bool = False  # a step computing its KV failed: cache none of it (until recomputed)
    cached_to: int = 0  # its chunks have cached its full blocks before this position
    # its tokens are taken one execution at a time (logprobs, a grammar): never in a run of
    # several executions (--decode-steps)
    stepwise: bool = False

    def __post_init__(self) -> None:
        self.known = len(self.prompt_ids) + len(self.output_ids)
        self.stop_ids = frozenset() if self.ignore_eos else self.eos_ids

    @property
    def num_inflight(self) -> int:
        """Tokens sampled by steps sent but not yet completed."""
        return self.known - len(self.prompt_ids) - len(self.output_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Tokens the scheduler knows: prompt + generated (not those still in flight)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not written yet: the whole prompt at first, 1 in decode."""
        return self.known - self.num_computed

    def max_length(self, max_context: int) -> int:
        """The most positions this request can ever hold: what `reserve` sets aside."""
        return min(len(self.prompt_ids) + self.max_tokens, max_context)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
