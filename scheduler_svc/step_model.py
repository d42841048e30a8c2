"""The online step-time model of one worker: the shared linear cost (`step_cost`) refitted as
the worker runs, from its own forward times.

- **Fit**: weighted least squares over every step seen (refitted every `REFIT_EVERY` steps),
  each weighted by 1/measured² (relative error: a 20 ms decode fits as well as a 2 s prefill)
  and by a forgetting factor (a step `k` steps old counts `FORGET**k`: about the last 50 steps
  matter), with every coefficient kept >= 0 (a feature whose fit is negative is dropped and
  the rest refitted, as the offline fit does), so the model stays monotone in every feature
  whatever it is fed.
- **Level**: the fit gives the shape of the cost, a factor on it its level: an exponential
  average of measured / fitted over the last few steps (weight `LEVEL_WEIGHT`; one step's
  ratio counts as at most `LEVEL_CLIP` times the level), and the fit learns each step divided
  by the level it was predicted with. A worker that gets uniformly slower (another job on its
  host, a throttled clock) is followed within a few steps by the level alone, without the fit
  mixing old steps with new ones of another mix (under a time budget every step is filled to
  the budget: the steps of each period look alike, and a fit that blends two periods gets the
  shape wrong).
- **Prior**: a cost model (a calibration file, `--cost-model`; else `BUILTIN_PRIOR`) enters the
  fit as pseudo-steps over a grid of shapes worth `PRIOR_WEIGHT` real step. It is the model
  until the first step is seen, and it keeps the fit defined in the directions the steps do not
  vary (a decode-only load never separates tokens from sampled rows); real steps outweigh it
  from the first few. Once steps are seen, its pseudo-steps stand at the steps' level (the
  prior times the geometric mean of measured / prior over the steps, forgotten as they are):
  the prior gives the cost's shape there, not its size. At its own size (the built-in is twice
  a slow CPU's) it pulled the fit of one stream's decodes (which cannot tell the fixed cost
  from a row's) toward a large cost per row, since that came nearer its large batches: a
  first draft token was predicted at 1.9x the step, so `auto` never drafted, and never saw
  a draft step that would have told it otherwise (docs/speculative.md).
- **Conservative before data**: `BUILTIN_PRIOR` is the committed SmolLM2-135M bf16 calibration
  (one CPU thread on a 2-core host) times two. It over-predicts for that model on any host at
  least half as fast, so a time budget admits less, not more, until the worker's own steps
  arrive; a slower worker corrects it within its first steps.
- **Error**: before a step is fitted, its prediction is compared with its measurement; p50/p90
  of |predicted - measured| / measured over the last `ERROR_WINDOW` steps.

Pure: no grpc, no torch, no numpy (6 unknowns: the normal equations are solved directly).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_svc.step_cost import BatchShape, CostModel

FORGET = 0.98  # per step: an observation's weight after k more steps is FORGET**k
LEVEL_WEIGHT = 0.2  # of the latest step in the level (measured / fitted, averaged)
LEVEL_CLIP = 1.25  # one step's measured / fitted counts as at most 1.25x (1/1.25x) the level:
# a hiccup of the host (one step 3x as long) moves the level by 5%, a worker twice as slow is
# followed in about five steps
PRIOR_WEIGHT = 0.5  # the prior's pseudo-steps together weigh as much as half a real step
ERROR_WINDOW = 256  # the recent steps the prediction error is measured over
REFIT_EVERY = 8  # steps observed between refits of the fit (the level follows every step): a
# refit solves the normal equations up to six times, in Python, on the scheduler's event loop
BUILTIN_PRIOR = CostModel(
    fixed=0.036,
    per_token=0.0025,
    per_sampled=0.0,
    per_kv_read=2.8e-6,
    per_attention=2.3e-6,
    meta={"source": "built-in: 2x SmolLM2-135M bf16, one CPU thread (over-predicts)"},
)
StepPredictor = Callable[[int, BatchShape], float]  # (worker index, shape) -> seconds


def prior_shapes() -> list[BatchShape]:
    """Where the prior is laid down: decodes at several batch sizes and contexts, prompt chunks
    of several lengths and starts, and a mixed step (the calibration grid's kinds)."""
    shapes = [BatchShape.of([(c, 1, True)] * b) for b in (1, 8, 64) for c in (64, 1024, 8192)]
    shapes += [BatchShape.of([(s, n, True)]) for n in (16, 256, 2048) for s in (0, 4096)]
    shapes += [BatchShape.of([(512, 1, True)] * 16 + [(0, 256, False)])]
    return shapes


@dataclass(frozen=True, slots=True)
class PredictionError:
    """|predicted - measured| / measured over the recent steps."""

    p50: float
    p90: float
    steps: int  # how many steps the figures are over


class OnlineStepModel:
    def __init__(self, prior: CostModel = BUILTIN_PRIOR, forget: float = FORGET) -> None:
        if not 0 < forget <= 1:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        self.prior = prior
        self.forget = forget
        self.observed = 0  # steps fitted
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        self.last = (0.0, 0.0)  # the last step seen: (predicted, measured) seconds
        n = len(prior.coefficients())
        self._prior_a, self._prior_b = _zeros(n), [0.0] * n  # at the prior's own size
        self._log_ratio, self._ratio_weight = 0.0, 0.0  # sum of log(measured / prior), weights
        shapes = [s for s in prior_shapes() if prior.predict(s) > 0]
        for shape in shapes:
            _accumulate(self._prior_a, self._prior_b, shape, prior.predict(shape),
                        PRIOR_WEIGHT / len(shapes))  # fmt: skip
        self._a, self._b = _zeros(n), [0.0] * n
        self._coef = prior.coefficients()
        self._unfitted = 0  # steps observed since the last refit
        self.level = 1.0  # the recent steps' measured / fitted

    def predict(self, shape: BatchShape) -> float:
        """Seconds of an execution of this shape on this worker (0 for an empty one)."""
        if not shape.tokens:
            return 0.0
        return self.level * self._fitted(shape)

    def _fitted(self, shape: BatchShape) -> float:
        if self._unfitted >= REFIT_EVERY or (self._unfitted and self.observed <= REFIT_EVERY):
            self._refit()  # every step while the first ones arrive, then every REFIT_EVERY
        return sum(c * x for c, x in zip(self._coef, shape.vector(), strict=True))

    def observe(self, shape: BatchShape, seconds: float) -> None:
        """A step of this shape took `seconds` on the worker: score the prediction, then fit."""
        if not shape.tokens or seconds <= 0:
            return  # nothing ran, or nothing was measured: no information
        fitted, level = self._fitted(shape), self.level
        predicted = level * fitted
        self.errors.append(abs(predicted - seconds) / seconds)
        self.last = (predicted, seconds)
        if fitted > 0:
            ratio = min(max(seconds / fitted, level / LEVEL_CLIP), level * LEVEL_CLIP)
            self.level += LEVEL_WEIGHT * (ratio - level)
        g = self.forget
        for row in self._a:
            row[:] = [g * v for v in row]
        self._b = [g * v for v in self._b]
        _accumulate(self._a, self._b, shape, seconds / level, 1.0)
        expected = self.prior.predict(shape)
        if expected > 0:
            self._log_ratio = g * self._log_ratio + math.log(seconds / level / expected)
            self._ratio_weight = g * self._ratio_weight + 1.0
        self.observed += 1
        self._unfitted += 1

    def error(self) -> PredictionError | None:
        """The recent prediction error; None before any step was seen."""
        if not self.errors:
            return None
        ranked = sorted(self.errors)
        return PredictionError(_rank(ranked, 0.5), _rank(ranked, 0.9), len(ranked))

    def model(self) -> CostModel:
        """The coefficients as they stand (the fit times the level)."""
        if self._unfitted:
            self._refit()
        return CostModel(*(self.level * c for c in self._coef), meta={"observed": self.observed})

    def prior_scale(self) -> float:
        """The steps' size against the prior's: the geometric mean of (measured / level) /
        prior over the steps seen, forgotten as they are; 1 before any."""
        if not self._ratio_weight:
            return 1.0
        return math.exp(self._log_ratio / self._ratio_weight)

    def _refit(self) -> None:
        """The fit of the steps and the prior's pseudo-steps at prior_scale times the prior
        (each pseudo-step's y scaled by r: its weight 1/y² by 1/r², its y by r)."""
        n, r = len(self._coef), self.prior_scale()
        a = [[self._a[i][j] + self._prior_a[i][j] / (r * r) for j in range(n)] for i in range(n)]
        b = [self._b[i] + self._prior_b[i] / r for i in range(n)]
        self._coef = _nonnegative_solve(a, b)
        self._unfitted = 0


class StepModels:
    """One online model per worker (by core index), made from one prior as workers appear;
    `predict` is the core's StepPredictor."""

    def __init__(self, prior: CostModel = BUILTIN_PRIOR) -> None:
        self.prior = prior
        self.models: dict[int, OnlineStepModel] = {}

    def of(self, worker: int) -> OnlineStepModel:
        model = self.models.get(worker)
        if model is None:
            model = self.models[worker] = OnlineStepModel(self.prior)
        return model

    def predict(self, worker: int, shape: BatchShape) -> float:
        return self.of(worker).predict(shape)

    def observe(self, worker: int, shape: BatchShape, seconds: float) -> None:
        self.of(worker).observe(shape, seconds)


def _zeros(n: int) -> list[list[float]]:
    return [[0.0] * n for _ in range(n)]


def _accumulate(a: list[list[float]], b: list[float], shape: BatchShape, y: float, w: float):
    """Add one weighted row (relative error: weight w / y²) to the normal equations."""
    x = shape.vector()
    w /= y * y
    for i, xi in enumerate(x):
        wxi = w * xi
        b[i] += wxi * y
        row = a[i]
        for j, xj in enumerate(x):
            row[j] += wxi * xj


def _nonnegative_solve(a: list[list[float]], b: list[float]) -> list[float]:
    """min |Xc - y|² with c >= 0 from the normal equations (a = XᵀX, b = Xᵀy): solve, drop the
    most negative coefficient, solve again on the rest, until none is negative."""
    active = list(range(len(b)))
    while active:
        sub = _solve([[a[i][j] for j in active] for i in active], [b[i] for i in active])
        worst = min(range(len(sub)), key=sub.__getitem__)
        if sub[worst] >= 0:
            break
        active.pop(worst)
    else:
        return [0.0] * len(b)  # every coefficient fitted negative (or there were none)
    coef = [0.0] * len(b)
    for i, v in zip(active, sub, strict=True):
        coef[i] = v
    return coef


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting, on the system scaled by its diagonal (the
    features span ten orders of magnitude); a singular direction gets 0."""
    n = len(b)
    d = [a[i][i] ** 0.5 if a[i][i] > 0 else 1.0 for i in range(n)]
    m = [[a[i][j] / (d[i] * d[j]) for j in range(n)] + [b[i] / d[i]] for i in range(n)]
    for i in range(n):
        m[i][i] += 1e-12
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-15:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                m[r] = [v - f * p for v, p in zip(m[r], m[col], strict=True)]
    x = [0.0] * n
    for i in reversed(range(n)):
        if abs(m[i][i]) < 1e-15:
            continue
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return [x[i] / d[i] for i in range(n)]


def _rank(ranked: list[float], q: float) -> float:
    """The q-quantile of sorted values (nearest rank)."""
    return ranked[min(len(ranked) - 1, int(q * len(ranked)))]


def prior_of(path: str) -> CostModel:
    """The prior of every worker's model: a calibration file (--cost-model), else the built-in."""
    return CostModel.load(path) if path else BUILTIN_PRIOR
