"""What one benchmark run produces: a record per request and Status samples over time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One request as its client saw it; times in seconds from the start of the run."""

    index: int
    prompt_tokens: int
    expected_tokens: int
    scheduled_s: float  # when it was due (open loop) or handed to a client (closed loop)
    sent_s: float = 0.0
    first_token_s: float | None = None
    end_s: float | None = None
    completion_tokens: int = 0
    token_gaps: list[float] = field(default_factory=list)  # between successive tokens
    queue_time_s: float | None = None  # the server's: submitted -> first admitted to a batch
    preemptions: int = 0
    finish: str = ""
    error: str = ""
    turn: int = -1  # a conversation's turn (0 = its first); -1 outside conversations
    # where completion_tokens came from: the stream's token ids (gRPC), or an OpenAI-compatible
    # server's `usage`, or its chunks with text counted one token each (no usable usage)
    tokens_basis: str = "token ids"
    usage_note: str = ""  # why a usage the server sent was not taken
    last_token_s: float | None = None  # when the latest tokens came (not in the CSV)

    def took(self, n: int, now: float) -> None:
        """`n` tokens came together at `now` (one message or chunk): the first sets the TTFT,
        the gap since the tokens before goes to the first of them, the rest come 0 s apart."""
        if not n:
            return
        if self.last_token_s is None:
            self.first_token_s = now
        else:
            self.token_gaps.append(now - self.last_token_s)
        self.token_gaps.extend([0.0] * (n - 1))
        self.last_token_s = now
        self.completion_tokens += n

    @property
    def ok(self) -> bool:
        return not self.error and self.end_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.scheduled_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.scheduled_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, averaged over the request (None: one token)."""
        gaps = self.token_gaps
        return sum(gaps) / len(gaps) if gaps else None

    def row(self) -> dict[str, Any]:
        """The request CSV's row. `token_gaps_s`: every gap between successive tokens, `;`-
        separated, rounded to the microsecond (0 for tokens that came in one message): the
        inter-token percentiles, `tpot_s` and the goodput can be recomputed from it."""
        return {
            "index": self.index,
            "prompt_tokens": self.prompt_tokens,
            "expected_tokens": self.expected_tokens,
            "completion_tokens": self.completion_tokens,
            "scheduled_s": _r(self.scheduled_s),
            "sent_s": _r(self.sent_s),
            "ttft_s": _r(self.ttft_s),
            "e2e_s": _r(self.e2e_s),
            "tpot_s": _r(self.tpot_s),
            "itl_max_s": _r(max(self.token_gaps, default=None)),
            "queue_time_s": _r(self.queue_time_s),
            "preemptions": self.preemptions,
            "finish": self.finish,
            "error": self.error,
            "turn": self.turn,
            "tokens_basis": self.tokens_basis,
            "usage_note": self.usage_note,
            "token_gaps_s": ";".join(f"{g:.6f}".rstrip("0").rstrip(".") for g in self.token_gaps),
        }


@dataclass(slots=True)
class StatusSample:
    """The scheduler's Status at time t (KV summed over workers)."""

    t: float
    waiting: int
    running: int
    kv_capacity: int
    kv_written: int
    kv_reserved_unwritten: int
    finished: int = 0
    preemptions: int = 0
    stalls: dict[str, int] = field(default_factory=dict)
    head_wait_reason: str = ""
    cached_blocks: int = 0  # prefix cache: blocks holding reusable contents (0 when off)
    evictable_blocks: int = 0  # of those, blocks no running request uses

    @property
    def kv_held(self) -> float:
        return self.kv_written + self.kv_reserved_unwritten


@dataclass(slots=True)
class RunResult:
    """One configuration on one workload."""

    label: str
    records: list[RequestRecord]
    samples: list[StatusSample]
    wall_s: float
    config: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, Any] = field(default_factory=dict)  # deltas of server counters
    kind: str = "served"  # served | simulated | transformers
    sample_period_s: float | None = None  # between Status samples (virtual s when simulated)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
