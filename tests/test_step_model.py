"""The online step-time model: it learns a worker's linear cost from its steps, follows a worker
that slows down, stays monotone whatever it is fed, and predicts from a calibration at once."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.step_cost import BatchShape, CostModel
from scheduler_svc.step_model import (
    BUILTIN_PRIOR,
    LEVEL_CLIP,
    LEVEL_WEIGHT,
    PRIOR_WEIGHT,
    REFIT_EVERY,
    OnlineStepModel,
    PredictionError,
    StepModels,
    _nonnegative_solve,
    _solve,
    prior_of,
    prior_shapes,
)

TRUTH = CostModel(
    fixed=0.004, per_token=0.0002, per_sampled=0.0001, per_kv_read=5e-7, per_attention=2e-9
)


def serving_shapes(rng: random.Random, n: int) -> list[BatchShape]:
    """Steps as a serving loop makes them: decodes at various contexts, some with a chunk."""
    shapes = []
    for _ in range(n):
        items = [(rng.randint(16, 3000), 1, True) for _ in range(rng.randint(1, 48))]
        if rng.random() < 0.4:
            items.append((rng.choice([0, 512, 2048]), rng.randint(8, 512), rng.random() < 0.5))
        shapes.append(BatchShape.of(items))
    return shapes


def relative_errors(model: OnlineStepModel, truth: CostModel, shapes: list[BatchShape]):
    return [abs(model.predict(s) - truth.predict(s)) / truth.predict(s) for s in shapes]


def test_converges_on_a_known_linear_cost() -> None:
    rng = random.Random(1)
    model = OnlineStepModel()
    for shape in serving_shapes(rng, 300):
        model.observe(shape, TRUTH.predict(shape))
    held_out = serving_shapes(rng, 100)
    assert max(relative_errors(model, TRUTH, held_out)) < 0.05
    recent = model.error()
    assert recent is not None and recent.p90 < 0.05 and recent.steps == 256


def test_the_error_is_measured_before_each_step_is_fitted() -> None:
    model = OnlineStepModel(prior=TRUTH.scaled(0.5))  # predicts twice the truth
    shape = BatchShape.of([(100, 1, True)] * 8)
    model.observe(shape, TRUTH.predict(shape))
    assert model.error().p50 == pytest.approx(1.0)  # |2t - t| / t


def test_follows_a_worker_that_gets_twice_as_slow() -> None:
    rng = random.Random(2)
    model = OnlineStepModel()
    for shape in serving_shapes(rng, 300):
        model.observe(shape, TRUTH.predict(shape))
    slower = TRUTH.scaled(0.5)
    held_out = serving_shapes(rng, 100)
    assert min(relative_errors(model, slower, held_out)) > 0.4  # it had learned the fast one
    for shape in serving_shapes(rng, 400):
        model.observe(shape, slower.predict(shape))
    assert max(relative_errors(model, slower, held_out)) < 0.05


def test_noisy_steps_still_fit_within_the_noise() -> None:
    rng = random.Random(3)
    model = OnlineStepModel()
    for shape in serving_shapes(rng, 500):
        model.observe(shape, TRUTH.predict(shape) * rng.uniform(0.9, 1.1))
    held_out = serving_shapes(rng, 100)
    assert sorted(relative_errors(model, TRUTH, held_out))[89] < 0.1


items = st.lists(
    st.tuples(st.integers(0, 4000), st.integers(1, 512), st.booleans()), min_size=1, max_size=16
)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(items, st.floats(1e-4, 5.0)), min_size=1, max_size=30),
    items,
    st.integers(1, 256),
)
def test_stays_monotone_whatever_it_is_fed(observed, batch, extra) -> None:
    model = OnlineStepModel()
    for work, seconds in observed:  # nonsense included: more work measured as less time
        model.observe(BatchShape.of(work), seconds)
    assert all(c >= 0 for c in model.model().coefficients())
    base = model.predict(BatchShape.of(batch))
    more = [(start, n + extra, sample) for start, n, sample in batch]
    assert model.predict(BatchShape.of(more)) >= base
    assert model.predict(BatchShape.of([*batch, (0, extra, False)])) >= base
    later = [(start + extra, n, sample) for start, n, sample in batch]
    assert model.predict(BatchShape.of(later)) >= base


def test_a_seeded_model_predicts_the_calibration_from_step_one() -> None:
    model = OnlineStepModel(prior=TRUTH)
    for shape in serving_shapes(random.Random(4), 20):
        assert model.predict(shape) == pytest.approx(TRUTH.predict(shape), rel=1e-9)
    assert model.error() is None and model.observed == 0


def test_a_seeded_model_on_the_right_worker_stays_right() -> None:
    rng = random.Random(5)
    model = OnlineStepModel(prior=TRUTH)
    for shape in serving_shapes(rng, 50):
        model.observe(shape, TRUTH.predict(shape))
    assert model.error().p90 < 1e-6


def test_the_builtin_prior_over_predicts_the_calibrated_cpu_worker() -> None:
    calibrated = CostModel(0.0177, 0.00124, 0.0, 1.376e-6, 1.121e-6)  # data/cost_models
    for shape in serving_shapes(random.Random(6), 50):
        assert BUILTIN_PRIOR.predict(shape) >= 1.9 * calibrated.predict(shape)


def test_an_empty_or_unmeasured_step_teaches_nothing() -> None:
    model = OnlineStepModel(prior=TRUTH)
    model.observe(BatchShape(), 1.0)
    model.observe(BatchShape.of([(5, 1, True)]), 0.0)
    assert model.observed == 0 and model.predict(BatchShape()) == 0.0


def test_each_worker_learns_its_own_speed() -> None:
    rng = random.Random(7)
    models = StepModels()
    for shape in serving_shapes(rng, 300):
        models.observe(0, shape, TRUTH.predict(shape))
        models.observe(1, shape, 3 * TRUTH.predict(shape))
    shape = BatchShape.of([(1000, 1, True)] * 32)
    assert models.predict(0, shape) == pytest.approx(TRUTH.predict(shape), rel=0.05)
    assert models.predict(1, shape) == pytest.approx(3 * TRUTH.predict(shape), rel=0.05)


def test_the_prior_is_the_calibration_file_given_else_the_builtin(tmp_path) -> None:
    path = tmp_path / "cost.json"
    TRUTH.save(path)
    assert prior_of(str(path)) == TRUTH and prior_of("") == BUILTIN_PRIOR
    assert SchedulerSettings(cost_model=str(path)).cost_model == str(path)
    with pytest.raises(ValueError, match="--cost-model .*missing.json: no such file"):
        SchedulerSettings(cost_model=str(tmp_path / "missing.json"))


def test_a_rare_slow_step_barely_moves_the_prediction() -> None:
    rng = random.Random(8)
    model = OnlineStepModel()
    for shape in serving_shapes(rng, 300):
        model.observe(shape, TRUTH.predict(shape))
    hiccup, after = serving_shapes(rng, 2)
    model.observe(hiccup, 5 * TRUTH.predict(hiccup))  # the host stalled the worker once
    assert model.predict(after) == pytest.approx(TRUTH.predict(after), rel=0.1)


def test_forget_is_a_factor_in_zero_to_one() -> None:
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=rf"forget must be in \(0, 1\], got {bad}"):
            OnlineStepModel(forget=bad)
    assert OnlineStepModel(forget=1.0).forget == 1.0  # no forgetting at all


def test_before_any_step_the_model_is_its_prior_exactly() -> None:
    model = OnlineStepModel(prior=TRUTH)
    assert model.prior is TRUTH and model.last == (0.0, 0.0)
    assert model.model().coefficients() == TRUTH.coefficients()
    assert model.model().meta == {"observed": 0}


def test_a_prior_that_predicts_nothing_is_learned_past() -> None:
    model = OnlineStepModel(prior=CostModel())
    shape = BatchShape.of([(100, 1, True)] * 4)
    assert model.predict(shape) == 0.0
    for s in serving_shapes(random.Random(9), 100):
        model.observe(s, TRUTH.predict(s))
    assert model.predict(shape) == pytest.approx(TRUTH.predict(shape), rel=0.05)


def test_each_step_is_scored_and_counted_and_the_error_is_by_nearest_rank() -> None:
    rng = random.Random(10)
    model = OnlineStepModel()
    errors = []
    for count, shape in enumerate(serving_shapes(rng, 20), start=1):
        predicted, measured = model.predict(shape), TRUTH.predict(shape) * rng.uniform(0.5, 2)
        model.observe(shape, measured)
        errors.append(abs(predicted - measured) / measured)
        assert model.last == (predicted, measured) and model.observed == count
        if count in (10, 20):
            ranked = sorted(errors)
            p50, p90 = ranked[count // 2], ranked[count * 9 // 10]
            assert model.error() == PredictionError(p50, p90, count)
    assert model.model().meta == {"observed": 20}


def test_one_step_moves_the_level_a_fifth_of_the_way_clipped_to_a_quarter() -> None:
    shape = BatchShape.of([(100, 1, True)] * 8)  # about 6 ms
    slower, faster = OnlineStepModel(prior=TRUTH), OnlineStepModel(prior=TRUTH)
    slower.observe(shape, 3 * TRUTH.predict(shape))
    faster.observe(shape, 0.3 * TRUTH.predict(shape))
    assert slower.level == pytest.approx(1 + LEVEL_WEIGHT * (LEVEL_CLIP - 1))  # 1.05
    assert faster.level == pytest.approx(1 + LEVEL_WEIGHT * (1 / LEVEL_CLIP - 1))  # 0.96
    same = OnlineStepModel(prior=TRUTH)
    same.observe(shape, 1.1 * TRUTH.predict(shape))
    assert same.level == pytest.approx(1 + LEVEL_WEIGHT * 0.1)


def test_a_step_measured_as_predicted_teaches_nothing_whatever_the_level() -> None:
    model = OnlineStepModel(prior=TRUTH, forget=1.0)
    first = BatchShape.of([(100, 1, True)] * 8)
    model.observe(first, 2 * TRUTH.predict(first))  # the level rises: 1.05
    shape, probes = BatchShape.of([(300, 1, True)] * 4), serving_shapes(random.Random(11), 20)
    before = [model.predict(s) for s in probes]
    model.observe(shape, model.predict(shape))  # it learns seconds / level: the fit it has
    assert [model.predict(s) for s in probes] == pytest.approx(before, rel=1e-9)


def test_the_fit_is_the_weighted_least_squares_of_the_steps_and_the_prior() -> None:
    """Relative error (weight 1/y²), a step k steps old weighted FORGET**k, each measurement
    divided by the level it was predicted with, the prior's grid worth PRIOR_WEIGHT step in
    all, at the steps' size: the prior times the weighted geometric mean of step / prior."""
    np = pytest.importorskip("numpy")
    slow = CostModel(0.006, 0.0003, 0.00015, 7e-7, 3e-9)
    model, rows = OnlineStepModel(prior=TRUTH, forget=0.9), []
    for shape in serving_shapes(random.Random(13), 6):
        rows.append((shape, slow.predict(shape) / model.level))
        model.observe(shape, slow.predict(shape))
    grid = prior_shapes()
    ages = [0.9 ** (len(rows) - 1 - k) for k in range(len(rows))]
    logs = [math.log(y / TRUTH.predict(s)) for s, y in rows]
    scale = math.exp(sum(w * v for w, v in zip(ages, logs, strict=True)) / sum(ages))
    assert model.prior_scale() == pytest.approx(scale, rel=1e-12)
    weighted = [(s, scale * TRUTH.predict(s), PRIOR_WEIGHT / len(grid)) for s in grid]
    weighted += [(s, y, w) for (s, y), w in zip(rows, ages, strict=True)]
    x = np.array([np.sqrt(w) / y * np.array(s.vector()) for s, y, w in weighted])
    want = np.linalg.lstsq(x, np.array([np.sqrt(w) for _, _, w in weighted]), rcond=None)[0]
    assert all(want > 0)  # the unconstrained fit is the constrained one
    got = [c / model.level for c in model.model().coefficients()]
    assert got == pytest.approx(list(want), rel=1e-6)


def test_the_fit_follows_every_step_at_first_then_every_refit_every_steps() -> None:
    """The level moves every step; the fit (here: the ratio of two predictions, which the level
    does not change) after each of the first REFIT_EVERY steps, then once every REFIT_EVERY."""
    model, slow = OnlineStepModel(prior=TRUTH), CostModel(0.004, 0.002, 0.0001, 5e-7, 2e-9)
    decodes, prompt = BatchShape.of([(100, 1, True)] * 8), BatchShape.of([(0, 256, True)])
    ratios = []
    for i in range(3 * REFIT_EVERY):
        shape = BatchShape.of([(0, 64 + 8 * i, True)])
        model.observe(shape, slow.predict(shape))
        ratios.append(model.predict(decodes) / model.predict(prompt))
    changed = [i + 1 for i in range(1, len(ratios)) if abs(ratios[i] / ratios[i - 1] - 1) > 1e-9]
    assert changed == [*range(2, REFIT_EVERY + 1), 2 * REFIT_EVERY, 3 * REFIT_EVERY]


def test_the_prior_is_laid_down_over_the_calibration_grid() -> None:
    def decodes(rows: int, context: int) -> BatchShape:
        return BatchShape.of([(context, 1, True)] * rows)

    grid = [decodes(b, c) for b in (1, 8, 64) for c in (64, 1024, 8192)]
    grid += [BatchShape.of([(s, n, True)]) for n in (16, 256, 2048) for s in (0, 4096)]
    grid += [decodes(16, 512) + BatchShape.item(0, 256, False)]
    assert prior_shapes() == grid
    assert decodes(8, 1024) == BatchShape(8, 8, 8 * 1025, 8 * 1025)


def test_every_worker_model_starts_from_the_prior_given() -> None:
    models = StepModels(prior=TRUTH)
    shape = BatchShape.of([(100, 1, True)] * 8)
    assert models.of(3).prior is TRUTH and models.predict(5, shape) == TRUTH.predict(shape)
    assert sorted(models.models) == [3, 5] and models.of(3) is models.of(3)


def test_solve_pivots_and_scales_small_known_systems() -> None:
    tridiagonal = [[2.0, 1.0, 0.0], [1.0, 2.0, 1.0], [0.0, 1.0, 2.0]]  # the last row's 0 pivots
    assert _solve(tridiagonal, [4.0, 8.0, 8.0]) == pytest.approx([1, 2, 3], rel=1e-9)
    tiny = [[1e-20, 0.0], [0.0, 4e-20]]  # features of very small values: the scaling keeps them
    assert _solve(tiny, [1e-20, 8e-20]) == pytest.approx([1, 2], rel=1e-9)
    assert _solve([[4.0, 0.0], [0.0, 0.0]], [8.0, 0.0]) == [pytest.approx(2), 0.0]  # singular


def test_solve_shrinks_a_direction_the_data_barely_fix_and_never_flips_it() -> None:
    d = 1e-13  # two features that differ by 1e-13: the ridge (1e-12) outweighs what separates them
    x = _solve([[1.0, 1 - d], [1 - d, 1.0]], [d, -d])  # exactly: (1, -1)
    assert 0 < x[0] < 1 and -1 < x[1] < 0


def test_nonnegative_solve_drops_a_negative_coefficient_and_refits_the_rest() -> None:
    # y = 1 + 2 t - 0.5 u over (t, u) in {0, 1}²: unconstrained u gets -0.5
    xs = [(1.0, t, u) for t in (0.0, 1.0) for u in (0.0, 1.0)]
    ys = [1 + 2 * t - 0.5 * u for _, t, u in xs]
    a = [[sum(x[i] * x[j] for x in xs) for j in range(3)] for i in range(3)]
    b = [sum(x[i] * y for x, y in zip(xs, ys, strict=True)) for i in range(3)]
    assert _solve(a, b) == pytest.approx([1, 2, -0.5])
    assert _nonnegative_solve(a, b) == pytest.approx([0.75, 2, 0])  # u dropped: the mean shifts


def test_nonnegative_solve_with_nothing_to_fit_answers_zeros() -> None:
    assert _nonnegative_solve([[1.0, 0.0], [0.0, 1.0]], [0.0, 0.0]) == [0.0, 0.0]
    assert _nonnegative_solve([[1.0, 0.5], [0.5, 1.0]], [-1.0, -2.0]) == [0.0, 0.0]
    assert _nonnegative_solve([], []) == []


def test_one_streams_decodes_leave_a_draft_token_priced_by_the_priors_shape() -> None:
    """One stream without drafts: every decode step is one row, so the steps cannot tell the
    fixed cost from a row's (fixed, per_sampled and the first rows' cost move together); the
    prior decides there, at the steps' size. At its own size (the built-in: twice a slow CPU)
    it pulled the fit toward a large cost per row, a first draft token priced at 1.9x the step,
    and `auto` never drafted (the a8 stack of docs/speculative.md). A worker whose decode is
    mostly fixed cost (5 ms + 0.4 ms a token) is now priced near its truth, and drafts pay."""
    from scheduler_svc.speculation.length import worth_drafting

    truth = CostModel(0.005, 0.0004, 0.0, 1e-7, 1e-9)
    rng, model = random.Random(3), OnlineStepModel()
    for _ in range(18):
        prompt = rng.randint(80, 140)
        chunk = BatchShape.of([(0, prompt, True)])
        model.observe(chunk, truth.predict(chunk))
        for i in range(128):
            shape = BatchShape.of([(prompt + i, 1, True)])
            model.observe(shape, truth.predict(shape) * rng.uniform(0.95, 1.05))
    one, draft = BatchShape.of([(200, 1, True)]), BatchShape.draft(200, 1)
    assert truth.predict(draft) / truth.predict(one) < 1.1
    assert model.predict(draft) / model.predict(one) < 1.2
    assert model.predict(BatchShape.draft(200, 5)) / model.predict(one) < 2.0
    assert worth_drafting(one, 1, model.predict, 0.6, 200, 0.0)
