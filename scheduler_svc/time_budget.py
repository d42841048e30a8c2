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
NEWTON_TRIES = 4  # guesses from the local slope before a cut bisects what is left
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
        if n <= 0:
            return 0
        whole_s = self.predict(self.shape + BatchShape.item(start, n, sample))
        if whole_s <= self.limit + SLACK:
            return n
        if whole:
            return n if least else 0
        return max(self._most_that_fit(start, n, None if sample else whole_s), min(least, n))

    def _most_that_fit(self, start: int, n: int, n_s: float | None) -> int:
        """The largest k < n whose chunk fits, given that all `n` do not (`n_s`: their time, if
        known). The predicted time grows with k (the model is monotone), so (fits, does not)
        bracket the answer. A guess is checked with its neighbour, which ends the search when
        they straddle the limit and else gives the local slope for the next guess: the cost is
        near linear in k, so it takes about four predictions where a bisection takes log2(n);
        after `NEWTON_TRIES` guesses the rest of the bracket is bisected (any monotone model)."""
        limit = self.limit + SLACK
        lo, hi = 0, n  # k = 0 (nothing added) fits: the caller's decodes run anyway
        lo_s = self.predict(self.shape)
        hi_s = self.predict(self.shape + BatchShape.item(start, n, False)) if n_s is None else n_s
        k = lo + int((hi - lo) * (limit - lo_s) / (hi_s - lo_s)) if hi_s > lo_s else hi // 2
        for _ in range(NEWTON_TRIES):
            k = min(max(k, lo + 1), hi - 1)
            k_s = self._time(start, k)
            step = 1 if k_s <= limit else -1
            other = k + step
            if not lo < other < hi:  # its neighbour is a bracket end: k or lo is the answer
                return k if k_s <= limit else lo
            other_s = self._time(start, other)
            if (k_s <= limit) != (other_s <= limit):  # they straddle the limit
                return min(k, other)
            if step > 0:
                lo, lo_s = other, other_s
            else:
                hi, hi_s = other, other_s
            slope = abs(other_s - k_s)
            if not slope > 0:
                break
            k = other + int((limit - other_s) / slope)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._time(start, mid) <= limit:
                lo = mid
            else:
                hi = mid
        return lo

    def _time(self, start: int, k: int) -> float:
        """The step's predicted time with `k` more tokens from `start` (a chunk that does not
        sample)."""
        return self.predict(self.shape + BatchShape.item(start, k, False))
