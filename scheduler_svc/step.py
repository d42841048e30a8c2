"""One worker's next execution as the core plans it: the step object that carries the worker,
the batch and the token budget left while it is being formed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler_svc.output import Event
from scheduler_svc.sequence import Sequence

if TYPE_CHECKING:
    from scheduler_svc.time_budget import StepTimer


@dataclass(slots=True)
class Work:
    """A multi-token share of an execution (a prompt, a chunk of it, or a recompute):
    `num_tokens` tokens from position `start`."""

    seq: Sequence
    handle: int
    start: int
    num_tokens: int
    sample: bool  # the chunk reaches the end of the known tokens: a new token comes out
    blocks: list[int] = field(default_factory=list)  # those it writes into (prefix caching)

    @property
    def token_ids(self) -> list[int]:
        prompt, end = self.seq.prompt_ids, self.start + self.num_tokens
        if self.start >= len(prompt):
            return self.seq.output_ids[self.start - len(prompt) : end - len(prompt)]
        return self.seq.tokens[self.start : end]


@dataclass(slots=True)
class Draft:
    """A decode with a draft (speculative decoding): the worker feeds the request the token it
    sampled last, at `start`, then `token_ids` at the positions after, in one execution, and
    answers with the tokens it kept (1 to len(token_ids) + 1)."""

    seq: Sequence
    handle: int
    start: int
    token_ids: list[int]


@dataclass(slots=True)
class Step:
    """What one worker executes next. Decodes carry no tokens: the worker feeds each request
    the token it sampled itself in the step before (it keeps it, with the block table and the
    sampling settings), so a decode is only its handle.

    The worker answers with the sampled tokens in this order: the chunks with `sample`, then
    the decodes."""

    worker: int
    budget: int  # tokens this execution may still take
    chunks: list[Work] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    decode_handles: list[int] = field(default_factory=list)
    added: list[Sequence] = field(default_factory=list)  # placed on the worker in this step
    grants: list[tuple[int, list[int]]] = field(default_factory=list)  # (handle, new blocks)
    # (handle, cached blocks): a request added in this step reads these blocks, already written,
    # as the start of its table (before its grants); its first chunk starts after them
    shares: list[tuple[int, list[int]]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)  # handles freed since the last step
    # what planning it did besides the batch: first admissions (queue time, cached tokens), and
    # the finishes of requests it failed because no live worker can ever hold them
    admissions: list[Event] = field(default_factory=list)
    failed: list[Event] = field(default_factory=list)
    timer: StepTimer | None = None  # its predicted time, under --step-time-budget-ms
    # (handle, blocks kept): reserved, unwritten blocks dropped from the end of its table
    trims: list[tuple[int, int]] = field(default_factory=list)
    # executions of the decodes in this step (--decode-steps): each feeds the token it sampled
    # to the next; the worker answers with `repeat` groups of the decodes' tokens, in order
    repeat: int = 1
    # decodes with a draft (speculative decoding; never with repeat > 1): their tokens follow
    # the decodes' in the worker's answer, draft by draft, as many as it kept of each
    drafts: list[Draft] = field(default_factory=list)
    # decodes (index in `decodes`, handle, the proposal's first token) that had a proposal but
    # no draft: their sampled token tells their acceptance rate for free (drafts.py)
    shadows: list[tuple[int, int, int]] = field(default_factory=list)
    # a decode had a proposal it could not draft (a decode run of its own in flight): the step
    # stays one execution, so that the next one may draft (a run would only start another)
    draft_next: bool = False

    @property
    def has_work(self) -> bool:
        return bool(self.decodes or self.chunks or self.drafts)

    @property
    def num_requests(self) -> int:
        return len(self.decodes) + len(self.chunks) + len(self.drafts)

    @property
    def num_tokens(self) -> int:
        drafted = sum(1 + len(d.token_ids) for d in self.drafts) if self.drafts else 0
        return len(self.decodes) + sum(w.num_tokens for w in self.chunks) + drafted

    @property
    def num_sampled(self) -> int:
        """Tokens the worker returns at least (a draft row returns one or more)."""
        sampled = len(self.decodes) * self.repeat + len(self.drafts)
        return sampled + sum(1 for w in self.chunks if w.sample)

    def sampled_seqs(self) -> list[Sequence]:
        """The requests whose tokens the worker returns, in its order (a draft row's first)."""
        drafts = [d.seq for d in self.drafts]
        return [w.seq for w in self.chunks if w.sample] + self.decodes * self.repeat + drafts

    def ran(self) -> dict[str, int]:
        """request id -> tokens processed in this step (all its executions)."""
        out = {s.request_id: self.repeat for s in self.decodes}
        out.update((w.seq.request_id, w.num_tokens) for w in self.chunks)
        out.update((d.seq.request_id, 1 + len(d.token_ids)) for d in self.drafts)
        return out
