"""The core-cost benchmark's steady states hold what they claim (no timing asserted here)."""

from __future__ import annotations

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


def test_core_cost_reports_a_row() -> None:
    row = core_cost(running=8, waiting=100, steps=3)
    assert (row.running, row.waiting) == (8, 100) and row.schedule_us > 0
