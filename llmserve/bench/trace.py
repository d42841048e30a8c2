"""The Azure LLM inference trace: parse, slice and scale (lengths and time)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO_ROOT / "data" / "traces" / "azure_llm_inference_conv_2023.csv"


@dataclass(frozen=True, slots=True)
class TraceRow:
    arrival_s: float  # seconds since the first row
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class TraceScale:
    """How a trace is replayed. Every report states these factors."""

    length_scale: float = 1.0  # prompt and output lengths are multiplied by this
    time_scale: float = 1.0  # arrival offsets are multiplied by this (>1: slower arrivals)
    start_s: float = 0.0  # slice of the original trace: rows with start_s <= arrival ...
    duration_s: float = 0.0  # ... < start_s + duration_s (0 = to the end)
    max_requests: int = 0  # 0 = no limit
    max_prompt_tokens: int = 0  # clip scaled prompts (0 = no clip), e.g. to a model's context
    max_output_tokens: int = 0  # clip scaled outputs (0 = no clip)

    def __post_init__(self) -> None:
        if self.length_scale <= 0 or self.time_scale <= 0:
            raise ValueError("length_scale and time_scale must be > 0")

    @property
    def load_factor(self) -> float:
        """Arrival rate relative to the original trace."""
        return 1.0 / self.time_scale


def parse_timestamp(text: str) -> datetime:
    """'2023-11-16 18:15:46.6805900' (7 fractional digits) -> datetime (microseconds)."""
    base, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(f"{base}.{(frac + '000000')[:6]}" if frac else base)


def load_trace(path: Path = DEFAULT_TRACE) -> list[TraceRow]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return []
    times = [parse_timestamp(r["TIMESTAMP"]) for r in rows]
    t0 = min(times)
    out = [
        TraceRow((t - t0).total_seconds(), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
        for t, r in zip(times, rows, strict=True)
    ]
    return sorted(out, key=lambda row: row.arrival_s)


def scale_trace(rows: list[TraceRow], scale: TraceScale) -> list[TraceRow]:
    """Slice, then scale: arrivals start at 0 and are stretched by time_scale; lengths are
    multiplied by length_scale (at least 1 token) and clipped."""
    end = scale.start_s + scale.duration_s if scale.duration_s else float("inf")
    picked = [r for r in rows if scale.start_s <= r.arrival_s < end]
    if scale.max_requests:
        picked = picked[: scale.max_requests]
    if not picked:
        return []
    t0 = picked[0].arrival_s
    return [
        TraceRow(
            (r.arrival_s - t0) * scale.time_scale,
            _scaled(r.prompt_tokens, scale.length_scale, scale.max_prompt_tokens),
            _scaled(r.output_tokens, scale.length_scale, scale.max_output_tokens),
        )
        for r in picked
    ]


def _scaled(tokens: int, factor: float, clip: int) -> int:
    n = max(1, round(tokens * factor))
    return min(n, clip) if clip else n
