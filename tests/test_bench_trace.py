"""Trace parsing and scaling, and the workloads built from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmserve.bench.trace import (
    DEFAULT_TRACE,
    TraceRow,
    TraceScale,
    load_trace,
    parse_timestamp,
    scale_trace,
)
from llmserve.bench.workload import fixed, from_trace, poisson, with_max_tokens

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.0000000,100,10
2023-11-16 18:15:47.5000000,201,3
2023-11-16 18:15:50.0000000,7,1
2023-11-16 18:15:52.2500000,4000,600
"""


@pytest.fixture
def small_trace(tmp_path: Path) -> list[TraceRow]:
    path = tmp_path / "trace.csv"
    path.write_text(CSV)
    return load_trace(path)


def test_seven_digit_fractions_parse_to_microseconds() -> None:
    t = parse_timestamp("2023-11-16 18:15:46.6805900")
    assert (t.second, t.microsecond) == (46, 680590)


def test_rows_are_relative_to_the_first_arrival(small_trace) -> None:
    assert [r.arrival_s for r in small_trace] == [0.0, 1.5, 4.0, 6.25]
    assert [(r.prompt_tokens, r.output_tokens) for r in small_trace][1] == (201, 3)


def test_the_repository_copy_is_the_whole_hour() -> None:
    rows = load_trace(DEFAULT_TRACE)
    assert len(rows) == 19_366
    assert rows[0].arrival_s == 0.0 and 3500 < rows[-1].arrival_s < 3600
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(rows, rows[1:], strict=False))
    assert 5.0 < len(rows) / rows[-1].arrival_s < 6.0  # about 5.5 requests/s
    assert max(r.prompt_tokens for r in rows) == 14050
    assert (DEFAULT_TRACE.parent / "README.md").read_text().count("CC-BY 4.0") >= 1


def test_lengths_scale_round_and_never_reach_zero(small_trace) -> None:
    scaled = scale_trace(small_trace, TraceScale(length_scale=0.1))
    assert [(r.prompt_tokens, r.output_tokens) for r in scaled] == [
        (10, 1),
        (20, 1),
        (1, 1),
        (400, 60),
    ]


def test_time_scale_stretches_arrivals(small_trace) -> None:
    scaled = scale_trace(small_trace, TraceScale(time_scale=2.0))
    assert [r.arrival_s for r in scaled] == [0.0, 3.0, 8.0, 12.5]
    assert TraceScale(time_scale=0.25).load_factor == 4.0


def test_a_slice_starts_at_zero_and_respects_limits(small_trace) -> None:
    scaled = scale_trace(small_trace, TraceScale(start_s=1.0, duration_s=4.0))
    assert [(r.arrival_s, r.prompt_tokens) for r in scaled] == [(0.0, 201), (2.5, 7)]
    assert len(scale_trace(small_trace, TraceScale(max_requests=3))) == 3
    clipped = scale_trace(small_trace, TraceScale(max_prompt_tokens=300, max_output_tokens=5))
    assert max(r.prompt_tokens for r in clipped) == 300
    assert max(r.output_tokens for r in clipped) == 5


def test_bad_scales_are_refused() -> None:
    with pytest.raises(ValueError):
        TraceScale(length_scale=0)


def test_trace_workloads_keep_timestamps_or_use_clients(small_trace) -> None:
    scale = TraceScale(length_scale=0.5, time_scale=2.0)
    open_loop = from_trace(scale, small_trace)
    assert not open_loop.closed
    assert [r.arrival_s for r in open_loop.requests] == [0.0, 3.0, 8.0, 12.5]
    assert open_loop.params["length_scale"] == 0.5 and open_loop.params["time_scale"] == 2.0
    closed = from_trace(scale, small_trace, concurrency=2)
    assert closed.closed and all(r.arrival_s is None for r in closed.requests)
    assert [r.limit for r in open_loop.requests] == [5, 2, 1, 300]  # exact: max_tokens = length
    capped = with_max_tokens(open_loop, 100)
    assert [r.limit for r in capped.requests] == [100, 100, 100, 300]
    assert [r.output_tokens for r in capped.requests] == [5, 2, 1, 300]


def test_fixed_and_poisson_workloads() -> None:
    w = fixed(10, 16, 64, concurrency=4)
    assert w.closed and w.output_tokens == 640 and w.prompt_tokens == 160
    p = poisson(200, rate=5.0, prompt_tokens=8, output_tokens=4, seed=1)
    arrivals = [r.arrival_s for r in p.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert 25 < arrivals[-1] < 60  # about 200 / 5 = 40 s
    assert poisson(5, 5.0, 8, 4, seed=1).requests == p.requests[:5]
