"""The step-time budget held on average over a window of steps (--step-time-window W): a
worker's step may take what its last W - 1 planned steps left of W x the budget, so a long
prompt chunk follows short decode steps; W = 1 is the per-step budget of test_time_budget."""

from __future__ import annotations

import pytest

from llmserve.status_text import time_budget_text
from scheduler_svc.config import MAX_TIME_WINDOW, CoreConfig
from scheduler_svc.live_settings import SettingError, apply
from scheduler_svc.step_cost import step_shape
from tests.sim import check_invariants, seq
from tests.test_time_budget import FakeTimes, make


def run_planned(core, times: FakeTimes) -> list[tuple[dict[str, int], float]]:
    """One step of every worker: what it ran and its predicted ms."""
    out = []
    for s in core.schedule_all():
        out.append((s.ran(), 1e3 * times(s.worker, step_shape(s))))
        core.complete(s, [7] * s.num_sampled)
    check_invariants(core)
    return out


def test_a_chunk_takes_what_the_short_steps_before_it_left() -> None:
    """The seed's B decodes (1 ms a token, 5 ms budget): three decode steps of 1 ms leave a
    window of 4 steps 17 ms, so C's prompt gets 16 tokens beside B's decode; the next three
    steps have no time left, and C's chunk gets the one token of progress a running prompt
    always makes; then what they left (20 - 3 x 2 ms) gives it 13."""
    times = FakeTimes(token_ms=0.0)
    core = make(times, budget_ms=5.0, step_time_window=4, token_budget=64)
    core.add(seq("B", 3, max_tokens=40))
    run_planned(core, times)  # B's prompt, free
    times.set(0, 0.0, 1.0)
    history = [run_planned(core, times)[0] for _ in range(3)]
    assert [ran for ran, _ in history] == [{"B": 1}] * 3
    core.add(seq("C", 40, max_tokens=3))
    history += [run_planned(core, times)[0] for _ in range(5)]
    assert [ran for ran, _ in history[3:]] == [
        {"B": 1, "C": 16}, {"B": 1, "C": 1}, {"B": 1, "C": 1}, {"B": 1, "C": 1}, {"B": 1, "C": 13}
    ]  # fmt: skip
    assert [ms for _, ms in history[3:]] == [17.0, 2.0, 2.0, 2.0, 14.0]


def test_a_window_of_one_is_the_per_step_budget() -> None:
    times = FakeTimes(token_ms=0.0)
    core = make(times, budget_ms=5.0, step_time_window=1, token_budget=64)
    core.add(seq("B", 3, max_tokens=40))
    run_planned(core, times)
    times.set(0, 0.0, 1.0)
    for _ in range(3):
        run_planned(core, times)
    core.add(seq("C", 40, max_tokens=3))
    assert [run_planned(core, times)[0][0] for _ in range(3)] == [{"B": 1, "C": 4}] * 3


def test_a_window_of_two_gives_a_step_what_the_one_before_left() -> None:
    """W = 2, 5 ms: after B's 1 ms decode step the next may take 9 ms (8 of C's tokens beside
    B's decode), the one after it 1 ms (the one token of progress), then 9 again."""
    times = FakeTimes(token_ms=0.0)
    core = make(times, budget_ms=5.0, step_time_window=2, token_budget=64)
    core.add(seq("B", 3, max_tokens=40))
    run_planned(core, times)
    times.set(0, 0.0, 1.0)
    run_planned(core, times)
    core.add(seq("C", 40, max_tokens=3))
    history = [run_planned(core, times)[0] for _ in range(3)]
    assert [ran for ran, _ in history] == [{"B": 1, "C": 8}, {"B": 1, "C": 1}, {"B": 1, "C": 7}]
    assert [ms for _, ms in history] == pytest.approx([9.0, 2.0, 8.0])


def test_the_average_holds_over_every_window_under_arrivals() -> None:
    """Requests arriving over 60 steps on two workers, 2 ms fixed + 0.5 ms a token, 10 ms held
    over 3 steps: every 3 consecutive steps of a worker are predicted within 30 ms (the decodes
    alone never fill a step here), and every request ends."""
    times = FakeTimes(fixed_ms=2.0, token_ms=0.5)
    core = make(times, budget_ms=10.0, workers=2, step_time_window=3, token_budget=256)
    per_worker: dict[int, list[float]] = {0: [], 1: []}
    for i in range(200):
        if i < 60 and i % 4 == 0:
            core.add(seq(f"r{i}", 10 + (i * 7) % 50, max_tokens=4 + i % 5))
        for s in core.schedule_all():
            if s.has_work:
                per_worker[s.worker].append(1e3 * times(s.worker, step_shape(s)))
            core.complete(s, [7] * s.num_sampled)
        check_invariants(core)
        if not core.seqs and i >= 60:
            break
    assert not core.seqs and core.finished == 15
    for ms in per_worker.values():
        assert ms and all(sum(ms[i : i + 3]) <= 30.0 + 1e-9 for i in range(len(ms) - 2))
    assert max(max(ms) for ms in per_worker.values()) > 10.0  # a step did use the window


def test_the_window_is_a_live_setting_with_bounds() -> None:
    config = apply(CoreConfig(step_time_budget_ms=50), {"step-time-window": "8"})
    assert config.step_time_window == 8
    for bad in ("0", str(MAX_TIME_WINDOW + 1), "two"):
        with pytest.raises(SettingError, match="step_time_window"):
            apply(config, {"step_time_window": bad})


def test_status_says_the_budget_is_an_average() -> None:
    assert time_budget_text({"step_time_budget_ms": 50.0, "step_time_window": 4}) == (
        "  step-time budget 50 ms on average over 4 steps"
    )
    assert time_budget_text({"step_time_budget_ms": 50.0, "step_time_window": 1}) == (
        "  step-time budget 50 ms"
    )
