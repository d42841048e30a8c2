"""What the core hands out besides steps: what its calls did (Outputs: tokens, admissions,
finishes), snapshots, refusals."""

from __future__ import annotations

from collections import Counter
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
    cached_tokens: int = 0  # with admitted: the prompt tokens its first admission found cached


@dataclass(slots=True)
class StepTokens:
    """The tokens a step sampled, as one value (one event per token costs the step loop an
    object each): request i got tokens[i], except the requests in `dropped` (moved, finished
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
class Outputs:
    """What one call into the core did, returned to its caller (nothing is posted to a queue
    drained elsewhere): the tokens a step sampled, the requests admitted, those finished."""

    tokens: StepTokens | None = None
    admissions: list[Event] = field(default_factory=list)
    finishes: list[Event] = field(default_factory=list)

    def parts(self) -> list[Event | StepTokens]:
        """What `EventRelay.dispatch` takes: the admissions, the tokens, the finishes (the
        relay merges a request's news into one message, so a finish never overtakes a
        token of the same call)."""
        tokens = [self.tokens] if self.tokens is not None else []
        return [*self.admissions, *tokens, *self.finishes]

    def events(self) -> list[Event]:
        """One Event per admission, token and finish, in that order (tests, the simulator)."""
        tokens = [Event(rid, token_id=token) for rid, token in self.tokens or ()]
        return [*self.admissions, *tokens, *self.finishes]


@dataclass(slots=True)
class StepLogprobs:
    """The logprobs of a step's tokens, for the requests that asked, after its tokens: each a
    (request id, common_pb2.TokenLogprobs) pair."""

    items: list[tuple[str, object]]

    @staticmethod
    def owners(
        step, tokens: list[int] | None = None, emitted: list[int] | None = None
    ) -> list[str | None]:  # step: scheduler_svc.step.Step
        """Whose logprobs each of the step's sampled tokens carries, in the worker's order
        (sampling chunks, then decodes, then each draft's `emitted` tokens); None for a token
        that is dropped (a draft's past the one that ends its request too) or not asked for.
        Read before `complete`, which moves and finishes requests."""
        chunks = [(w.seq, w.handle) for w in step.chunks if w.sample]
        pairs = chunks + list(zip(step.decodes, step.decode_handles, strict=True))
        owners = [
            seq.request_id if seq.handle == handle and seq.sampling.logprobs is not None else None
            for seq, handle in pairs
        ]
        at = len(owners)
        for draft, n in zip(step.drafts, emitted or (), strict=False):
            seq = draft.seq
            asked = seq.handle == draft.handle and seq.sampling.logprobs is not None
            keep = seq.kept((tokens or [])[at : at + n]) if asked else 0
            owners += [seq.request_id] * keep + [None] * (n - keep)
            at += n
        return owners


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
    cached_blocks: int = 0  # blocks whose contents the prefix cache names (held or not)
    evictable_blocks: int = 0  # cached, held by nobody: counted in `free`
    evictions: int = 0  # cached blocks taken for other contents (cumulative)
    prompt_tokens: int = 0  # tokens needing KV at each admission (cumulative)
    hit_tokens: int = 0  # of those, served from the cache (cumulative)


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


@dataclass(slots=True)
class TenantCounts:
    """Requests by tenant and by SLO class ("" = none), as the scheduler's metrics export them."""

    policy: str
    queued: Counter[str] = field(default_factory=Counter)
    running: Counter[str] = field(default_factory=Counter)
    class_queued: Counter[str] = field(default_factory=Counter)
    class_running: Counter[str] = field(default_factory=Counter)
    service: dict[str, float] = field(default_factory=dict)  # fair's counters (VTC)
