"""How long each request's draft is in a step: `fixed` (as long as the proposal and the limits
allow) or `auto`, SmartSpec's rule on this project's step-time model.

A request's draft tokens are accepted one after another, each with probability `a` (its running
acceptance rate), until the first rejection; the worker adds one token of its own. A draft of
`k` tokens therefore emits, on average, 1 + a + a² + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens,
and its (k+1)-th draft token adds a^(k+1). `auto` starts every row at 0 and adds draft tokens
one at a time, always to the row whose next token is most likely to be accepted, while the
step's expected emitted tokens per predicted second rise: a token whose expected gain is
below the step's current tokens per second is not worth its predicted time. One decode row
alone (a fixed cost dominates its step) drafts up to its limit; in a large batch, whose time
grows with its tokens, each draft token costs about what a row's token costs and adds only
a^(k+1) < 1: the rule falls to 0 by itself."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_svc.step_cost import BatchShape

SLACK = 1e-12  # seconds, as the time budget's (a step predicted at the limit fits)
ShapePredictor = Callable[[BatchShape], float]


@dataclass(frozen=True, slots=True)
class Row:
    """A decoding request that may draft: its input's position, the most draft tokens it may
    take (its proposal's length and its limits), and its acceptance rate."""

    start: int
    cap: int
    rate: float


def token_shape(start: int, k: int) -> BatchShape:
    """What the (k+1)-th draft token adds to a row whose input is at `start`
    (`BatchShape.draft(start, k + 1)` less `BatchShape.draft(start, k)`): one token, one more
    row through the LM head, one more position read, and its attention over the context and
    the row's tokens before it."""
    return BatchShape(1, 1, 1, start + k + 2)


def fixed_lengths(
    rows: list[Row], base: BatchShape, predict: ShapePredictor, budget: int, limit: float
) -> list[int]:
    """Each row's whole cap, in order, while the token budget (and the time limit, when > 0)
    last; a row the time cuts drafts what fits."""
    lengths, shape = [0] * len(rows), base
    for i, row in enumerate(rows):
        for k in range(min(row.cap, budget)):
            more = shape + token_shape(row.start, k)
            if limit and predict(more) > limit + SLACK:
                break
            shape, lengths[i], budget = more, k + 1, budget - 1
    return lengths


def worth_drafting(
    base: BatchShape, sampled: int, predict: ShapePredictor, rate: float, start: int, limit: float
) -> bool:
    """Could `auto` give any row a draft token? Only if the best first token there could be (the
    highest acceptance `rate` of the rows, at the shortest context `start`: the cheapest) raises
    the step's tokens per second: the first token of a row gains the most, and the greedy rule
    stops at the first that does not pay. A step under load answers no before any proposal is
    looked up."""
    seconds = predict(base)
    more_s = predict(base + token_shape(start, 0))
    if limit and more_s > limit + SLACK:
        return False
    return seconds > 0 and (sampled + rate) * seconds > sampled * more_s


def auto_lengths(
    rows: list[Row],
    base: BatchShape,
    sampled: int,
    predict: ShapePredictor,
    budget: int,
    limit: float,
) -> list[int]:
    """Draft lengths that maximise the step's expected emitted tokens per predicted second
    (greedy marginal allocation; `sampled`: the tokens the step emits without drafts)."""
    lengths, shape = [0] * len(rows), base
    seconds, tokens = predict(base), float(sampled)
    heap = [(-row.rate, i) for i, row in enumerate(rows) if row.cap > 0 and row.rate > 0]
    heapq.heapify(heap)
    while heap and budget > 0 and seconds > 0:
        gain, i = heapq.heappop(heap)
        row, k = rows[i], lengths[i]
        more = shape + token_shape(row.start, k)
        more_s = predict(more)
        if limit and more_s > limit + SLACK:
            continue  # this row's token does not fit the time left; a shorter context's may
        if (tokens - gain) * seconds <= tokens * more_s:
            break  # the best gain left lowers the step's tokens per second
        shape, seconds, tokens, budget = more, more_s, tokens - gain, budget - 1
        lengths[i] = k + 1
        if k + 1 < row.cap:
            heapq.heappush(heap, (gain * row.rate, i))
    return lengths
