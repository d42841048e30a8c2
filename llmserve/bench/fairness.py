"""Service between tenants as VTC counts it ("Fairness in Serving Large Language Models", OSDI
2024): prompt tokens weighted 1 and sampled tokens 2, divided by the tenant's weight, step by
step; the difference between two tenants over the stretches both are backlogged (requests
waiting), against the paper's bound; and Jain's index over the tenants' weighted rates."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from scheduler_svc.queues.fair import DECODE_WEIGHT, PREFILL_WEIGHT
from scheduler_svc.step import Step


def step_service(step: Step) -> Counter[str]:
    """Each tenant's service in `step`, in VTC's units (unweighted)."""
    got: Counter[str] = Counter()
    for work in step.chunks:
        got[work.seq.tenancy.tenant] += PREFILL_WEIGHT * work.num_tokens
    for seq in step.decodes:
        got[seq.tenancy.tenant] += DECODE_WEIGHT * step.repeat
    return got


def vtc_bound(max_prompt: int, max_output: int, batch_tokens: int) -> float:
    """2 * max(w_p * L_in + w_q * L_out, w_q * M): the paper's bound on the service difference
    between two backlogged tenants (M: the tokens of one batch)."""
    return 2 * max(PREFILL_WEIGHT * max_prompt + DECODE_WEIGHT * max_output,
                   DECODE_WEIGHT * batch_tokens)  # fmt: skip


def jain(values: list[float]) -> float | None:
    """(sum x)^2 / (n * sum x^2): 1 when all are equal, 1/n when one gets everything."""
    squares = sum(x * x for x in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else None


@dataclass(slots=True)
class PairGap:
    """Two tenants' weighted service difference inside the stretches where both are
    backlogged: `widest` is the largest |difference| over any interval inside one stretch."""

    a: str
    b: str
    diff: float = 0.0  # a's weighted service minus b's since the stretch began
    low: float = 0.0
    high: float = 0.0
    widest: float = 0.0
    stretches: int = 0
    steps: int = 0  # steps planned while both were backlogged
    served_a: float = 0.0  # their unweighted service in those steps
    served_b: float = 0.0
    open: bool = False

    def record(self, got: Counter[str], weights: dict[str, float], both: bool) -> None:
        if not both:
            self.open = False
            return
        if not self.open:
            self.open, self.diff, self.low, self.high = True, 0.0, 0.0, 0.0
            self.stretches += 1
        self.steps += 1
        self.served_a += got[self.a]
        self.served_b += got[self.b]
        self.diff += got[self.a] / weights[self.a] - got[self.b] / weights[self.b]
        self.low, self.high = min(self.low, self.diff), max(self.high, self.diff)
        self.widest = max(self.widest, self.high - self.low)

    def figures(self) -> dict[str, Any]:
        return {
            "tenants": [self.a, self.b],
            "max_difference": self.widest,
            "backlogged_stretches": self.stretches,
            "backlogged_steps": self.steps,
            "service_while_backlogged": {self.a: self.served_a, self.b: self.served_b},
            "service_ratio": self.served_a / self.served_b if self.served_b else None,
        }


class ServiceLedger:
    """Every planned step's service per tenant, and which tenants were backlogged as it was
    planned."""

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights
        self.service: Counter[str] = Counter()
        self.pairs = [PairGap(a, b) for a, b in combinations(weights, 2)]

    def record(self, step: Step, backlogged: set[str]) -> None:
        got = step_service(step)
        self.service.update(got)
        for pair in self.pairs:
            pair.record(got, self.weights, pair.a in backlogged and pair.b in backlogged)

    def figures(self) -> dict[str, Any]:
        return {
            "service": {t: self.service[t] for t in self.weights},
            "weighted_service": {t: self.service[t] / w for t, w in self.weights.items()},
            "pairs": [p.figures() for p in self.pairs],
        }
