"""The state of one request as the scheduler sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum

from llmcommon.sampling import SamplingParams
from llmcommon.tenancy import Tenancy
from scheduler_svc.speculation.acceptance import ACCEPT_PRIOR

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


# identity: list.remove() must not compare every field; weakly referenced by the KV records
@dataclass(slots=True, eq=False, weakref_slot=True)
class Sequence:
    """Counts are kept as plain fields (not properties) because the step loop reads them for
    every running request in every step.

    `num_computed` counts the positions whose KV is written once the steps already sent have run;
    `num_planned` = prompt + output + the tokens those steps will sample (with overlap, one step
    ahead): the scheduler has planned them, but learns the sampled ones only when their step
    completes. What the KV layer keeps of a request (its blocks, prefix keys, how far it is
    cached) is the KV layer's own record (kv_records.py), not here."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    eos_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # the worker's sampling settings, checked at the scheduler's door (stop strings are the
    # gateway's; stop_token_ids every id that ends the request)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_planned: int = 0  # set from the prompt in __post_init__
    # on its worker: `num_planned` at which nothing more is sampled (0 once finished), and the
    # tokens it may generate (max_tokens, or fewer where the worker's context ends first)
    max_planned: int = 0
    output_limit: int = 0
    stop_ids: frozenset[int] = frozenset()  # tokens that end it: eos_ids unless ignore_eos
    status: SeqStatus = SeqStatus.WAITING
    finish: Finish | None = None
    error: str = ""
    worker: int | None = None
    handle: int = NO_HANDLE  # its id on the worker's step stream; changes with every placement
    admitted_at: float | None = None  # first admission (queue time ends)
    preemptions: int = 0
    cache_salt: bytes = b""  # seeds its prefix-cache keys: only requests of equal salt share
    # its tokens are taken one execution at a time (logprobs, a grammar): never in a run of
    # several executions (--decode-steps)
    stepwise: bool = False
    # speculative decoding: a step with its draft is in flight (its position is known only when
    # it completes: it is planned into no other step before), and its running acceptance rate
    drafting: bool = False
    acceptance: float = ACCEPT_PRIOR
    # its tenant, priority and SLO class: what the queue's ordering reads (the gateway's)
    tenancy: Tenancy = field(default_factory=Tenancy)

    def __post_init__(self) -> None:
        self.num_planned = len(self.prompt_ids) + len(self.output_ids)
        self.stop_ids = frozenset() if self.ignore_eos else self.eos_ids

    @property
    def num_inflight(self) -> int:
        """Tokens sampled by steps sent but not yet completed."""
        return self.num_planned - len(self.prompt_ids) - len(self.output_ids)

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
        return self.num_planned - self.num_computed

    def max_length(self, max_context: int) -> int:
        """The most positions this request can ever hold: what `reserve` sets aside."""
        return min(len(self.prompt_ids) + self.max_tokens, max_context)

    def kept(self, tokens: list[int]) -> int:
        """How many of `tokens`, appended to its output one after another, it keeps: up to the
        first that ends it (a stop token, its length), that one included."""
        room = self.output_limit - len(self.output_ids)
        stops = self.stop_ids
        for i, token in enumerate(tokens[:room]):
            if token in stops:
                return i + 1
        return min(len(tokens), max(room, 0))

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
