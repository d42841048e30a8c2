"""Execution time of one worker batch as a function of the work in it, fitted to measurements.

    seconds = fixed + per_token * tokens + per_sampled * sampled + per_kv_read * kv_read
              + per_attention * attention

- tokens: new tokens processed (prefill chunks + decodes)
- sampled: rows that go through the LM head (one per item that samples)
- kv_read: KV positions read, summed over items (each item reads its whole context)
- attention: query x key pairs, summed over items (n new tokens from position s: n*s + n(n+1)/2)

Coefficients are fitted by least squares with all of them kept >= 0, so the model is monotone
in every feature (more tokens never take less time).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmserve.bench.trace import REPO_ROOT

FEATURES = ["tokens", "sampled", "kv_read", "attention"]
DEFAULT_COST_MODEL = REPO_ROOT / "data" / "cost_models" / "smollm2-bf16-cpu.json"


@dataclass(frozen=True, slots=True)
class BatchShape:
    """The work of one execution, as the cost model sees it."""

    tokens: int = 0
    sampled: int = 0
    kv_read: int = 0
    attention: int = 0

    @staticmethod
    def of(items: list[tuple[int, int, bool]]) -> BatchShape:
        """items: (start position, tokens processed, samples?) per request."""
        return BatchShape(
            tokens=sum(n for _, n, _ in items),
            sampled=sum(1 for *_, s in items if s),
            kv_read=sum(start + n for start, n, _ in items),
            attention=sum(n * start + n * (n + 1) // 2 for start, n, _ in items),
        )

    def vector(self) -> list[float]:
        return [1.0, *(float(getattr(self, f)) for f in FEATURES)]


@dataclass(frozen=True, slots=True)
class CostModel:
    fixed: float = 0.0
    per_token: float = 0.0
    per_sampled: float = 0.0
    per_kv_read: float = 0.0
    per_attention: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def seconds(self, shape: BatchShape) -> float:
        if not shape.tokens:
            return 0.0
        return (
            self.fixed
            + self.per_token * shape.tokens
            + self.per_sampled * shape.sampled
            + self.per_kv_read * shape.kv_read
            + self.per_attention * shape.attention
        )

    def scaled(self, speedup: float) -> CostModel:
        """The same shape on hardware `speedup` times faster (every coefficient divided)."""
        c = self.coefficients()
        return CostModel(*(v / speedup for v in c), meta=self.meta | {"speedup": speedup})

    def coefficients(self) -> list[float]:
        return [self.fixed, self.per_token, self.per_sampled, self.per_kv_read, self.per_attention]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @staticmethod
    def load(path: Path = DEFAULT_COST_MODEL) -> CostModel:
        raw = json.loads(Path(path).read_text())
        return CostModel(**raw)


def fit(
    shapes: list[BatchShape], seconds: list[float], meta: dict[str, Any] | None = None
) -> CostModel:
    """Non-negative least squares (features with a negative fit are dropped and refitted),
    weighted by 1/seconds so that short steps (decodes) fit as well as long ones."""
    x = np.array([s.vector() for s in shapes])
    y = np.array(seconds)
    w = 1.0 / np.maximum(y, 1e-6)
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(x.shape[1])
    full[active] = np.maximum(coef, 0)
    predicted = x @ full
    stats = {
        "samples": len(y),
        "r2": float(1 - ((y - predicted) ** 2).sum() / ((y - y.mean()) ** 2).sum()),
        "median_abs_rel_error": float(np.median(np.abs(predicted - y) / y)),
    }
    return CostModel(*map(float, full), meta=(meta or {}) | {"fit": stats})
