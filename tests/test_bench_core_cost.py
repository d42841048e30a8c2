"""The core-cost benchmark's steady states hold what they claim, and its figures are the fastest
measured step (on a scripted clock: no real timing is asserted)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from llmserve.bench import core_cost as core_cost_module
from llmserve.bench.core_cost import SteadyState, core_cost


def test_decode_steady_state_keeps_running_and_queue_fixed() -> None:
    state = SteadyState(running=16, waiting=500)
    state.measure(steps=5)
    assert sum(len(ws.running) for ws in state.core.workers) == 16
    assert len(state.core.waiting) == 500
    assert state.core.head_reason is not None and state.core.head_reason.value == "max_running"


def test_admitting_steady_state_admits_every_step_and_keeps_the_queue_length() -> None:
    state = SteadyState(running=16, waiting=200, admit=4)
    admitted = state.core.admitted
    state.measure(steps=5)
    assert state.core.admitted - admitted == 4 * 8  # 3 warm-up steps + 5 measured
    assert len(state.core.waiting) == 200
    # between steps: the 12 long-lived ones run; the 4 admitted this step finished after 1
    # token and leave at the next step
    running = [s for ws in state.core.workers for s in ws.running]
    assert len(running) == 16 and sum(1 for s in running if not s.is_finished) == 12


def test_measure_reports_the_fastest_measured_step_in_microseconds(monkeypatch) -> None:
    """On a scripted clock: three warm-up steps (faster than any measured one) are left out,
    and schedule() and postprocessing each report their own fastest step."""
    state = SteadyState(running=4, waiting=10)
    warm_up = [(1, 1)] * 3  # (schedule, postprocess) in microseconds
    measured = [(30, 44), (12, 50), (25, 21), (40, 60)]
    ticks = [t for sched, post in warm_up + measured for t in (1000, sched, post)]
    clock = itertools.accumulate(t * 1e-6 for t in ticks)
    monkeypatch.setattr(core_cost_module, "time", SimpleNamespace(perf_counter=clock.__next__))
    assert state.measure(steps=4) == pytest.approx((12, 21))


def test_core_cost_reports_a_row_of_its_configuration() -> None:
    row = core_cost(running=8, waiting=100, admit=2, steps=3)
    assert (row.running, row.admitted_per_step, row.waiting) == (8, 2, 100)
