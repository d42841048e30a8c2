"""The online step-time model: it learns a worker's linear cost from its steps, follows a worker
that slows down, stays monotone whatever it is fed, and predicts from a calibration at once."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.step_cost import BatchShape, CostModel
from scheduler_svc.step_model import BUILTIN_PRIOR, OnlineStepModel, StepModels, prior_of

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
