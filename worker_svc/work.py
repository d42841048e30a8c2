"""What the scheduler asks the worker to run: one request's tokens for one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SamplingSettings:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # 1 means off
    top_k: int = 0  # 0 means off
    seed: int | None = None  # None means a fresh random draw each time
    min_p: float = 0.0  # 0 means off
    presence_penalty: float = 0.0  # over generated tokens
    frequency_penalty: float = 0.0  # over generated tokens
    repetition_penalty: float = 1.0  # over prompt and generated tokens; 1 means off
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # stop_token_ids are masked until this many are generated
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # top alternatives returned with each token; None: no logprobs
    grammar: Any = None  # structured output: the request's GrammarState (worker_svc/grammar.py)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Needs the request's previous tokens."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def needs_history(self) -> bool:
        """Keeps the tokens it processed: for its penalties, or to rebuild its grammar's state
        after a recompute."""
        return self.penalized or self.grammar is not None

    @property
    def shapes_logits(self) -> bool:
        """Changes the logits before temperature: then even a greedy row is not a plain argmax."""
        return (
            self.grammar is not None
            or bool(self.logit_bias)
            or self.penalized
            or (self.min_tokens > 0 and bool(self.stop_token_ids))
        )


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-softmax of the raw model logits: the sampled token's, and the top ones'."""

    logprob: float
    top_ids: tuple[int, ...] = ()  # most likely first
    top_logprobs: tuple[float, ...] = ()


@dataclass(slots=True)
class WorkItem:
    request_id: str
    token_ids: list[int]  # tokens to process now
    start_position: int  # position of token_ids[0]
    block_table: list[int]  # KV block ids holding positions 0..start+len-1, in order
    sample: bool = True  # False for a prompt chunk that doesn't reach the end
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    sample_index: int = 0  # number of tokens generated so far
    history: list[int] = field(default_factory=list)  # tokens processed before, if penalized
    cached: int = 0  # positions at the start read from blocks shared with others, never written
    logprobs: TokenLogprobs | None = None  # of the token sampled last, if asked

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What an execution processed, taken before it runs (it then advances its items)."""

    phase: str  # prefill | decode | mixed
    tokens: int
    sampled: int


def phase_of(items: list[WorkItem]) -> str:
    """decode: every item feeds back its last sampled token; prefill: none does; else mixed."""
    decodes = sum(1 for i in items if i.sample_index > 0 and len(i.token_ids) == 1)
    if decodes == len(items):
        return "decode"
    return "prefill" if decodes == 0 else "mixed"


def shape_of(items: list[WorkItem]) -> BatchShape | None:
    if not items:
        return None
    tokens = sum(len(i.token_ids) for i in items)
    return BatchShape(phase_of(items), tokens, sum(1 for i in items if i.sample))
