"""What the scheduler asks the worker to run: one request's tokens for one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmcommon.sampling import GREEDY, SamplingParams


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
    sampling: SamplingParams = GREEDY
    sample_index: int = 0  # number of tokens generated so far
    history: list[int] = field(default_factory=list)  # tokens processed before, if penalized
    cached: int = 0  # positions at the start read from blocks shared with others, never written
    logprobs: TokenLogprobs | None = None  # of the token sampled last, if asked
    grammar: Any = None  # structured output: the request's GrammarState (worker_svc/grammar.py)
    drafted: int = 0  # speculative decoding: the last `drafted` of token_ids are a draft
    emitted: list[tuple[int, TokenLogprobs | None]] = field(default_factory=list)  # a draft's

    @property
    def fed(self) -> int:
        """How many of token_ids are known (not a draft): its history runs up to them."""
        return len(self.token_ids) - self.drafted

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
    decodes = sum(1 for i in items if i.sample_index > 0 and i.fed == 1)  # a draft decodes
    if decodes == len(items):
        return "decode"
    return "prefill" if decodes == 0 else "mixed"


def shape_of(items: list[WorkItem]) -> BatchShape | None:
    if not items:
        return None
    tokens = sum(len(i.token_ids) for i in items)
    return BatchShape(phase_of(items), tokens, sum(1 for i in items if i.sample))
