"""The budget sweep of `bench sim`: fixed token budgets against step-time budgets on the same
arrivals, and which of each kind did best (by goodput)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scheduler_svc.config import MAX_TIME_WINDOW


@dataclass(frozen=True, slots=True)
class Budget:
    """What limits a worker's step: a token count alone, or a predicted time under a token cap."""

    token_budget: int
    time_budget_ms: float = 0.0  # 0: the token budget alone
    time_window: int = 1  # the steps the time budget holds over on average (--step-time-window)

    @property
    def kind(self) -> str:
        return "time" if self.time_budget_ms else "tokens"

    @property
    def label(self) -> str:
        if self.time_budget_ms:
            over = f" x{self.time_window}" if self.time_window > 1 else ""
            return f"time {self.time_budget_ms:g} ms{over}"
        return f"tokens {self.token_budget}"


def budgets(
    token_budgets: list[int], time_budgets_ms: list[float | tuple[float, int]], cap: int
) -> list[Budget]:
    """The token budgets, then the time budgets (each under the token budget `cap`); a time
    budget is T (ms) or (T, window)."""
    timed = [t if isinstance(t, tuple) else (t, 1) for t in time_budgets_ms]
    return [Budget(n) for n in token_budgets] + [Budget(cap, t, w) for t, w in timed]


def time_budget_list(text: str) -> list[tuple[float, int]]:
    """An argparse type: comma-separated step-time budgets, each T (ms, > 0) or TxW (held on
    average over W steps, 1 to MAX_TIME_WINDOW), e.g. "50,100,100x4"."""
    out = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        t, sep, w = item.partition("x")
        try:
            budget, window = float(t), int(w) if sep else 1
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected T or TxW (milliseconds, steps), e.g. 100 or 100x4"
            ) from None
        if not budget > 0 or not 1 <= window <= MAX_TIME_WINDOW:
            raise argparse.ArgumentTypeError(
                f"{item!r}: T must be > 0 and W 1 to {MAX_TIME_WINDOW}"
            )
        out.append((budget, window))
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more budgets")
    return out


def positive_list(kind: Callable[[str], float]) -> Callable[[str], list]:
    """An argparse type: comma-separated numbers of `kind` (int or float), each > 0."""

    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of {kind.__name__}s"
            ) from None
        if not values or any(not v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: give one or more values, each > 0")
        return values

    return parse


def best(rows: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """The row of this budget kind with the highest goodput (then the most output tokens/s)."""
    of_kind = [r for r in rows if r["kind"] == kind]
    return max(
        of_kind,
        key=lambda r: (r["goodput_rps"] or 0.0, r["output_tokens_per_s"]),
        default=None,
    )


def verdicts(rows: list[dict[str, Any]], by: tuple[str, ...] = ("load", "policy")) -> list[dict]:
    """Per group of rows (by load and policy; a served sweep: by round and policy): the best
    token budget, the best time budget, the ratio of their goodputs, and the best time budget's
    p99 inter-token time over its budget."""
    out = []
    for key in dict.fromkeys(tuple(r[k] for k in by) for r in rows):
        group = [r for r in rows if tuple(r[k] for k in by) == key]
        tokens, timed = best(group, "tokens"), best(group, "time")
        out.append(
            dict(zip(by, key, strict=True))
            | {
                "best_token_budget": tokens and tokens["budget"],
                "best_token_goodput_rps": tokens and tokens["goodput_rps"],
                "best_time_budget": timed and timed["budget"],
                "best_time_goodput_rps": timed and timed["goodput_rps"],
                "goodput_ratio": _ratio(timed, tokens),
                "itl_p99_over_budget": _itl_over_budget(timed),
                "best_time_window": (timed or {}).get("time_window", 1),
            }
        )
    return out


def _ratio(timed: dict[str, Any] | None, tokens: dict[str, Any] | None) -> float | None:
    if not timed or not tokens or timed["goodput_rps"] is None or not tokens["goodput_rps"]:
        return None
    return timed["goodput_rps"] / tokens["goodput_rps"]


def _itl_over_budget(timed: dict[str, Any] | None) -> float | None:
    if not timed or timed["itl_p99_s"] is None:
        return None
    return 1000 * timed["itl_p99_s"] / timed["time_budget_ms"]
