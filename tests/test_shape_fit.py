"""`python -m llmserve.bench.shape_fit`'s grid and its held-out scoring (no model timed here)."""

from __future__ import annotations

import numpy as np

from llmserve.bench import shape_fit
from scheduler_svc.step_cost import BatchShape, CostModel


def test_the_grid_is_seeded_and_mixes_decodes_with_chunks() -> None:
    grid = shape_fit.random_grid(70)
    assert grid == shape_fit.random_grid(70)
    assert any(p.decodes and p.chunks for p in grid)  # mixed steps
    assert any(p.decodes and not p.chunks for p in grid) and any(not p.decodes for p in grid)
    assert all(p.chunks or p.decodes for p in grid)  # never an empty step


def test_steps_the_model_can_express_are_predicted_exactly_held_out() -> None:
    """Times made by a cost model with the sixth feature: with it the held-out error is ~0, and
    without it (five linear features) the concave part is missed."""
    truth = CostModel(0.01, 0.0005, 0.0001, 1e-6, 1e-9, per_small_token=0.003)
    grid = shape_fit.random_grid(70)
    seconds = np.array([truth.predict(BatchShape.of(p.items())) for p in grid])
    with_knee = shape_fit.held_out_errors(shape_fit.features(grid, 8), seconds)
    linear = shape_fit.held_out_errors(shape_fit.features(grid, 0), seconds)
    assert with_knee.max() < 1e-6
    assert np.percentile(linear, 90) > 0.05
