"""The cost model: features of a batch, the non-negative fit, and monotonicity."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmserve.bench.cost_model import DEFAULT_COST_MODEL, BatchShape, CostModel, fit

items = st.lists(
    st.tuples(st.integers(0, 4000), st.integers(1, 512), st.booleans()), min_size=1, max_size=64
)


def test_features_of_a_mixed_batch() -> None:
    # two decodes at positions 9 and 19, and a prompt chunk of 4 tokens from position 8
    shape = BatchShape.of([(9, 1, True), (19, 1, True), (8, 4, False)])
    assert shape == BatchShape(
        tokens=6, sampled=2, kv_read=10 + 20 + 12, attention=10 + 20 + (4 * 8 + 10)
    )


def test_fit_recovers_known_coefficients() -> None:
    truth = CostModel(
        fixed=0.02, per_token=0.001, per_sampled=0.0003, per_kv_read=2e-6, per_attention=1e-8
    )
    shapes = [BatchShape.of([(c, 1, True)] * b) for b in (1, 4, 16, 64) for c in (16, 512, 2048)]
    shapes += [BatchShape.of([(s, n, True)]) for n in (32, 256, 1024) for s in (0, 1000)]
    model = fit(shapes, [truth.seconds(s) for s in shapes])
    for got, want in zip(model.coefficients(), truth.coefficients(), strict=True):
        assert abs(got - want) <= 1e-6 * max(1.0, want * 1e6)
    assert model.meta["fit"]["r2"] > 0.999


def test_fit_never_returns_negative_coefficients() -> None:
    shapes = [BatchShape.of([(0, n, True)]) for n in (1, 10, 100, 1000)]
    seconds = [0.5, 0.4, 0.3, 0.2]  # faster with more tokens: nonsense, clipped to >= 0
    assert all(c >= 0 for c in fit(shapes, seconds).coefficients())


@given(items, st.integers(1, 256))
def test_the_committed_model_is_monotone_in_tokens(batch, extra) -> None:
    model = CostModel.load(DEFAULT_COST_MODEL)
    more = [(start, n + extra, sample) for start, n, sample in batch]
    assert model.seconds(BatchShape.of(more)) >= model.seconds(BatchShape.of(batch))
    longer = batch + [(0, extra, False)]
    assert model.seconds(BatchShape.of(longer)) >= model.seconds(BatchShape.of(batch))


def test_the_committed_model_says_where_it_was_measured() -> None:
    model = CostModel.load(DEFAULT_COST_MODEL)
    assert model.meta["command"].startswith("llmserve bench calibrate")
    assert model.meta["machine"]["cpus"] >= 1 and model.fixed > 0 and model.per_token > 0
    shape = BatchShape(tokens=5, sampled=5, kv_read=50)
    assert model.scaled(10).seconds(shape) == pytest.approx(model.seconds(shape) / 10)
