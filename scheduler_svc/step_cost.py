"""Execution time of one worker batch as a linear function of the work in it, shared by the
scheduler (its online model, the time budget) and the simulator (`llmserve bench`):

    seconds = fixed + per_token * tokens + per_sampled * sampled + per_kv_read * kv_read
              + per_attention * attention + per_small_token * min(tokens, SMALL_ROWS)

- tokens: new tokens processed (prefill chunks + decodes)
- sampled: rows that go through the LM head (one per item that samples)
- kv_read: KV positions read, summed over items (each item reads its whole context)
- attention: query x key pairs, summed over items (n new tokens from position s: n*s + n(n+1)/2)
- min(tokens, SMALL_ROWS): the step's first rows, which cost more each than the rest where a
  step of a few rows is bound by reading the weights and above by computing (a CPU worker under
  `--quantization auto`: the int4 kernel's time grows by row up to its row figure, 8, oneDNN's
  bf16 above is flat to 16 rows, then linear). Concave in tokens, still monotone; what it gains
  in prediction error (`python -m llmserve.bench.shape_fit`) is in docs/figures.md.

Every coefficient is >= 0, so the model is monotone in every feature (more work never takes
less time). Pure: no grpc, no torch, no numpy.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler_svc.step import Step

FEATURES = ["tokens", "sampled", "kv_read", "attention", "small_tokens"]
SMALL_ROWS = 8  # the rows of the small_tokens feature


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

    @staticmethod
    def item(start: int, n: int, sample: bool) -> BatchShape:
        """One request's share: `n` tokens from position `start`."""
        return BatchShape(n, int(sample), start + n, n * start + n * (n + 1) // 2)

    @staticmethod
    def draft(start: int, k: int) -> BatchShape:
        """A decode with a draft of `k` (speculative decoding): 1 + k tokens from `start`,
        every row through the LM head (each verifies a draft token or samples the next)."""
        n = 1 + k
        return BatchShape(n, n, start + n, n * start + n * (n + 1) // 2)

    def __add__(self, other: BatchShape) -> BatchShape:
        return BatchShape(
            self.tokens + other.tokens,
            self.sampled + other.sampled,
            self.kv_read + other.kv_read,
            self.attention + other.attention,
        )

    def vector(self) -> list[float]:
        return [1.0, float(self.tokens), float(self.sampled), float(self.kv_read),
                float(self.attention), float(min(self.tokens, SMALL_ROWS))]  # fmt: skip


@dataclass(frozen=True, slots=True)
class CostModel:
    fixed: float = 0.0
    per_token: float = 0.0
    per_sampled: float = 0.0
    per_kv_read: float = 0.0
    per_attention: float = 0.0
    per_small_token: float = 0.0  # seconds per token of the first SMALL_ROWS
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        negative = [f.name for f in fields(self) if f.name != "meta" and getattr(self, f.name) < 0]
        if negative:
            raise ValueError(f"cost model coefficients must be >= 0: {', '.join(negative)}")

    def predict(self, shape: BatchShape) -> float:
        """Seconds of an execution of this shape (an empty one takes none)."""
        if not shape.tokens:
            return 0.0
        return (
            self.fixed
            + self.per_token * shape.tokens
            + self.per_sampled * shape.sampled
            + self.per_kv_read * shape.kv_read
            + self.per_attention * shape.attention
            + self.per_small_token * min(shape.tokens, SMALL_ROWS)
        )

    seconds = predict  # the name the benchmarks use

    def scaled(self, speedup: float) -> CostModel:
        """The same shape on hardware `speedup` times faster (every coefficient divided)."""
        c = self.coefficients()
        return CostModel(*(v / speedup for v in c), meta=self.meta | {"speedup": speedup})

    def coefficients(self) -> list[float]:
        return [self.fixed, self.per_token, self.per_sampled, self.per_kv_read, self.per_attention,
                self.per_small_token]  # fmt: skip

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @staticmethod
    def load(path: Path | str) -> CostModel:
        """A calibration file (`llmserve bench calibrate` writes them)."""
        raw = json.loads(Path(path).read_text())
        return CostModel(**raw)


def step_shape(step: Step) -> BatchShape:
    """The shape of a step as planned (read before it completes: a decode is at the position
    its request had computed up to when planned)."""
    items = [(w.start, w.num_tokens, w.sample) for w in step.chunks]
    items += [(s.num_computed - 1, 1, True) for s in step.decodes]
    shape = BatchShape.of(items)
    for draft in step.drafts:
        shape += BatchShape.draft(draft.start, len(draft.token_ids))
    return shape
