"""When a decode run pays (--decode-runs auto): the loop's time outside the forward that a run
saves, against the arrivals it holds back, as a worker's step-time model predicts them.

A step of one execution costs its worker `e + o` seconds: `e` the forward (the step-time model's
prediction), `o` the rest of the loop's period (planning, the messages, the worker between
steps, streaming the tokens: measured, `LoopOverhead`). A run of `r` executions costs
`r·e + o`: each of its `n` rows saves `(r - 1)·o`, so the run gains `n·(r - 1)·o` row-seconds.
A request arriving meanwhile waits for the run's end, up to `(r - 1)·e` longer than between
single executions; `λ·(r·e + o)` of them arrive (λ: the worker's share of the recent arrival
rate, `ArrivalRate`), so the run costs `λ·(r·e + o)·(r - 1)·e` row-seconds (a waiting request
is a row that does not decode). The run pays while

    n·o > λ·e·(r·e + o),   that is   r ≤ (n·o / (λ·e) - o) / e,

the longest such run, up to the setting's most. Without arrivals every run pays (one stream);
without a measured overhead none does (the loop's time is the forward's: a run saves nothing);
under load `e` grows with the rows, so runs shorten (and RUN_LIMIT_S bounds them again)."""

from __future__ import annotations

import math
from collections import deque

OVERHEAD_WEIGHT = 0.1  # the newest step's share of the overhead's running mean
ARRIVAL_WINDOW_S = 10.0  # arrivals counted over this long for the rate
MAX_ARRIVALS = 4096  # arrivals kept for the rate (beyond that the window is shorter)


def worthwhile_runs(
    rows: int, execution_s: float, overhead_s: float, arrivals_per_s: float, most: int
) -> int:
    """The executions a decode-only step of `rows` requests should run (1: no run), at most
    `most`, by the rule above."""
    if most < 2 or rows < 1 or overhead_s <= 0.0 or execution_s <= 0.0:
        return 1
    if arrivals_per_s <= 0.0:
        return most
    longest = (rows * overhead_s / (arrivals_per_s * execution_s) - overhead_s) / execution_s
    if longest < 2:
        return 1
    return min(most, math.floor(longest))


class LoopOverhead:
    """A worker's loop period outside the forward, per step: a running mean of each step's wall
    share (from the last result to this one, or from its send after an idle loop) less its
    forward seconds. 0 until a step is seen."""

    __slots__ = ("seconds", "observed")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.observed = 0

    def observe(self, period_s: float, forward_s: float) -> None:
        rest = max(0.0, period_s - forward_s)
        self.observed += 1
        if self.observed == 1:
            self.seconds = rest
        else:
            self.seconds += OVERHEAD_WEIGHT * (rest - self.seconds)


class ArrivalRate:
    """Requests added per second over the last ARRIVAL_WINDOW_S (or since the first, when that
    is sooner and at least a second ago)."""

    __slots__ = ("times", "first")

    def __init__(self) -> None:
        self.times: deque[float] = deque(maxlen=MAX_ARRIVALS)
        self.first: float | None = None

    def add(self, now: float) -> None:
        if self.first is None:
            self.first = now
        self.times.append(now)

    def per_second(self, now: float) -> float:
        times = self.times
        while times and times[0] < now - ARRIVAL_WINDOW_S:
            times.popleft()
        if not times or self.first is None:
            return 0.0
        span = min(ARRIVAL_WINDOW_S, max(1.0, now - self.first))
        if len(times) == MAX_ARRIVALS:  # the oldest kept is newer than the window's start
            span = min(span, max(1e-3, now - times[0]))
        return len(times) / span
