"""The step-time budget (`--step-time-budget-ms`): one worker's step, as the core forms it,
kept within a predicted time.

The core hands each step a `StepTimer` with the worker's predictor (its online step-time model,
`step_model.py`, or any shape -> seconds). The running decodes always go in; a prompt chunk, a
running request's or an admitted one's, goes in only as far as the step's predicted time stays
within the limit: it is cut to the most tokens that fit. The caller keeps one token of progress
in every step (`least`), and the token budget stays the hard cap (it bounds `n` before the cut).
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc.step_cost import BatchShape

SLACK = 1e-12  # seconds: a step predicted at the limit exactly fits, whatever the rounding
ShapePredictor = Callable[[BatchShape], float]  # seconds of a step of this shape


class StepTimer:
    def __init__(self, predict: ShapePredictor, limit_s: float) -> None:
        self.predict = predict
        self.limit = limit_s
        self.shape = BatchShape()  # what the step holds so far

    def add(self, start: int, n: int, sample: bool) -> None:
        """`n` tokens from position `start` join the step (a chunk, or a decode: n = 1)."""
        self.shape += BatchShape.item(start, n, sample)

    def add_decodes(self, contexts: int, count: int) -> None:
        """`count` decodes whose contexts, new token included, sum to `contexts`."""
        self.shape += BatchShape(count, count, contexts, contexts)

    def predicted(self) -> float:
        return self.predict(self.shape)

    def cut(self, start: int, n: int, sample: bool, least: int = 0, whole: bool = False) -> int:
        """The most of `n` tokens from `start` that keep the step within the limit, at least
        `least` of them (a step must make progress); `sample`: all `n` reach the end of the
        known tokens (the last one samples). `whole`: all `n` or none (no chunking)."""
        if n <= 0 or self._fits(start, n, sample):
            return max(n, 0)
        if whole:
            return n if least else 0
        lo, hi = 0, n - 1  # lo fits (nothing added); find the largest k < n that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(start, mid, False):
                lo = mid
            else:
                hi = mid - 1
        return max(lo, min(least, n))

    def _fits(self, start: int, n: int, sample: bool) -> bool:
        return self.predict(self.shape + BatchShape.item(start, n, sample)) <= self.limit + SLACK
