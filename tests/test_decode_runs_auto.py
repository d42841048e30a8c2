"""--decode-runs auto (scheduler_svc/run_rule.py): a decode-only step runs several executions only
as far as the loop's time outside the forward, saved for every row, outweighs the requests the
run holds back (the worker's step-time model and the recent arrival rate). None where the loop
costs nothing beside the forward; the most allowed where nothing arrives; shorter as arrivals
and the step's time grow. The outputs are those of single steps."""

from __future__ import annotations

import pytest

from scheduler_svc.config import CoreConfig, DecodeRuns, WorkerSpec
from scheduler_svc.live_settings import apply
from scheduler_svc.run_rule import (
    ARRIVAL_WINDOW_S,
    OVERHEAD_WEIGHT,
    ArrivalRate,
    LoopOverhead,
    worthwhile_runs,
)
from tests.sim import Recording, check_invariants, seq, step


@pytest.mark.parametrize(
    ("rows", "e", "o", "rate", "most", "runs"),
    [
        (1, 0.006, 0.003, 0.0, 8, 8),  # nothing arrives: the most allowed
        (1, 0.006, 0.0, 0.0, 8, 1),  # the loop costs nothing beside the forward: no run
        (1, 0.006, 0.003, 2.0, 8, 8),  # one stream, a request every half second: (41.2 -> 8)
        (8, 0.010, 0.001, 20.0, 8, 3),  # (8*0.001/(20*0.01) - 0.001)/0.01 = 3.9
        (8, 0.010, 0.0005, 20.0, 8, 1),  # (0.02 - 0.0005)/0.01 = 1.95: no run
        (64, 0.044, 0.003, 20.0, 8, 4),  # (0.218 - 0.003)/0.044 = 4.9
        (64, 0.044, 0.003, 60.0, 8, 1),  # (0.0727 - 0.003)/0.044 = 1.6
        (4, 0.01, 0.002, 1.0, 1, 1),  # a setting of 1: never
    ],
)
def test_the_rule_takes_the_longest_run_that_pays(rows, e, o, rate, most, runs) -> None:
    assert worthwhile_runs(rows, e, o, rate, most) == runs


def test_the_rule_is_the_inequality_it_states() -> None:
    """At every length it grants, n*o > rate*e*(r*e + o); one more would break it (below the
    most allowed)."""
    for rows in (1, 3, 8, 32, 64):
        for e in (0.002, 0.01, 0.05):
            for o in (0.0005, 0.002, 0.01):
                for rate in (0.5, 5.0, 50.0):
                    r = worthwhile_runs(rows, e, o, rate, 32)
                    if r > 1:
                        assert rows * o >= rate * e * (r * e + o) * (1 - 1e-9)
                    if r < 32:
                        assert rows * o < rate * e * ((r + 1) * e + o)


def test_the_overhead_is_a_running_mean_of_the_period_less_the_forward() -> None:
    overhead = LoopOverhead()
    assert overhead.seconds == 0.0
    overhead.observe(0.010, 0.007)
    assert overhead.seconds == pytest.approx(0.003)
    overhead.observe(0.010, 0.010)
    assert overhead.seconds == pytest.approx(0.003 * (1 - OVERHEAD_WEIGHT))
    overhead.observe(0.005, 0.009)  # a forward longer than its share (overlap): nothing, not less
    assert overhead.seconds == pytest.approx(0.003 * (1 - OVERHEAD_WEIGHT) ** 2)


def test_the_arrival_rate_counts_the_window() -> None:
    rate = ArrivalRate()
    assert rate.per_second(100.0) == 0.0
    for i in range(20):
        rate.add(100.0 + i * 0.5)  # two a second for ten seconds
    assert rate.per_second(110.0) == pytest.approx(2.0)
    assert rate.per_second(100.0 + 9.5 + ARRIVAL_WINDOW_S) == pytest.approx(0.1)  # the last
    assert rate.per_second(200.0) == 0.0
    young = ArrivalRate()
    young.add(5.0)
    young.add(5.2)
    assert young.per_second(5.5) == pytest.approx(2.0)  # at least a second's span
    assert young.per_second(9.0) == pytest.approx(0.5)  # 2 in the 4 s since the first


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, step_s: float, overhead_s: float, **cfg) -> Recording:
    """The seed's worker (24 positions, budget 8), each execution predicted at `step_s`, its
    loop's measured time outside the forward `overhead_s`."""
    cfg.setdefault("token_budget", 8)
    spec = WorkerSpec("w0", 24, 1, 4096)
    core = Recording(CoreConfig(**cfg), [spec], clock=clock, predict=lambda w, shape: step_s)
    if overhead_s:
        core.workers[0].overhead.observe(step_s + overhead_s, step_s)
    return core


def repeats(core: Recording, limit: int = 100) -> list[int]:
    """The executions of each step with work, until nothing is left."""
    out = []
    for _ in range(limit):
        steps = step(core)
        check_invariants(core)
        if not steps and not core.waiting:
            return out
        out += [s.repeat for s in steps if s.has_work]
    raise AssertionError("did not finish")


def test_auto_is_the_default_and_a_live_setting() -> None:
    assert CoreConfig().decode_runs is DecodeRuns.AUTO and CoreConfig().decode_steps == 8
    assert apply(CoreConfig(), {"decode-runs": "fixed"}).decode_runs is DecodeRuns.FIXED


def test_a_lone_request_with_a_costly_loop_runs_the_most_and_gets_the_same_tokens() -> None:
    """B (prompt 3, 17 tokens) alone: a 10 ms execution, 3 ms of loop beside it, one arrival:
    runs of 8 (its prompt step, then 8 + 8), the tokens of single steps."""
    outputs = {}
    for runs in ("auto", "fixed"):
        clock = Clock()
        core = make(clock, 0.010, 0.003, decode_runs=runs, decode_steps=1 if runs == "fixed" else 8)
        core.add(b := seq("B", 3, max_tokens=17))
        history = repeats(core)
        outputs[runs] = list(b.output_ids)
        if runs == "auto":
            assert history == [1, 8, 8]
    assert outputs["auto"] == outputs["fixed"] and len(outputs["auto"]) == 17


def test_no_run_where_the_loop_costs_nothing_beside_the_forward() -> None:
    clock = Clock()
    core = make(clock, 0.010, 0.0)
    core.add(seq("B", 3, max_tokens=9))
    assert set(repeats(core)) == {1}


def test_frequent_arrivals_shorten_runs_and_then_stop_them() -> None:
    """Two decodes, 10 ms an execution, 1 ms of loop: with 20 requests a second arriving runs
    are (2*0.001/(20*0.01) - 0.001)/0.01 = 0.9 long, so none; with 4 a second, 4.9: 4."""
    for arrivals_per_s, expected in ((20, 1), (4, 4)):
        clock = Clock()
        core = make(clock, 0.010, 0.001)
        for i in range(10 * arrivals_per_s):  # the last 10 s of arrivals, then these two
            core.arrivals.add(clock.now - 10 + i / arrivals_per_s)
        core.add(seq("B", 3, max_tokens=9))
        core.add(seq("D", 3, max_tokens=9))
        assert max(repeats(core)) == expected


def test_runs_shorten_as_the_batch_grows_under_the_same_arrivals() -> None:
    """The step's predicted time grows with its rows; at 2 a second with 2 ms of loop: a 10 ms
    step of 1 row runs (1*0.002/(2*0.01) - 0.002)/0.01 = 9.8 -> 8; one of 40 ms with 1 row:
    (0.025 - 0.002)/0.04 = 0.6, none."""
    for step_s, expected in ((0.010, 8), (0.040, 1)):
        clock = Clock()
        core = make(clock, step_s, 0.002)
        for i in range(20):
            core.arrivals.add(clock.now - 10 + i / 2)
        core.add(seq("B", 3, max_tokens=20))
        assert max(repeats(core)) == expected


def test_arrivals_counted_are_the_requests_added() -> None:
    clock = Clock()
    core = make(clock, 0.010, 0.003)
    for i in range(4):
        core.add(seq(f"r{i}", 3, max_tokens=2))
        clock.now += 0.5
    assert core.arrivals.per_second(clock.now) == pytest.approx(4 / 2.0)
    assert core._arrivals_here() == pytest.approx(2.0)
