"""The cost model of the benchmarks: the shared model (`scheduler_svc.step_cost`: the features
of a batch, the coefficients, load and save), the committed calibration, and the offline fit.

Coefficients are fitted by least squares with all of them kept >= 0, so the model is monotone
in every feature (more tokens never take less time)."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmserve.bench.trace import REPO_ROOT
from scheduler_svc.step_cost import FEATURES, BatchShape, CostModel

__all__ = ["DEFAULT_COST_MODEL", "FEATURES", "BatchShape", "CostModel", "fit"]

DEFAULT_COST_MODEL = REPO_ROOT / "data" / "cost_models" / "smollm2-bf16-cpu.json"


def fit(
    shapes: list[BatchShape], seconds: list[float], meta: dict[str, Any] | None = None
) -> CostModel:
    """Non-negative least squares (features with a negative fit are dropped and refitted),
    weighted by 1/seconds so that short steps (decodes) fit as well as long ones."""
    x = np.array([s.vector() for s in shapes])
    y = np.array(seconds)
    full = nonnegative_lstsq(x, y)
    predicted = x @ full
    stats = {
        "samples": len(y),
        "r2": float(1 - ((y - predicted) ** 2).sum() / ((y - y.mean()) ** 2).sum()),
        "median_abs_rel_error": float(np.median(np.abs(predicted - y) / y)),
    }
    return CostModel(*map(float, full), meta=(meta or {}) | {"fit": stats})


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients >= 0 minimising the relative error (rows weighted by 1/y): features with a
    negative fit are dropped, one at a time, and the rest refitted."""
    w = 1.0 / np.maximum(y, 1e-6)
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(x.shape[1])
    full[active] = np.maximum(coef, 0)
    return full
