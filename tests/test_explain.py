"""What would admit the head of the queue, on the seed's Figure 4 numbers (token budget 8, KV
capacity 24, B reserves 6 + 14 = 20 positions, C's prompt is 6 tokens)."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler_svc.config import CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.explain import Finisher, Holder, explain
from tests.sim import check_invariants, ran, seq, step
from tests.test_time_budget import FakeTimes


def figure4(policy: KvPolicy = KvPolicy.RESERVE, **cfg) -> Scheduler:
    """B holds KV for 6 positions and is in decode; C (6 prompt tokens) waits."""
    config = CoreConfig(**({"token_budget": 8, "policy": policy} | cfg))
    core = Scheduler(config, [WorkerSpec("w0", 24, 1, 4096)], clock=lambda: 10.0)
    core.add(seq("B", 6, max_tokens=14, arrival=1.0))
    step(core)
    core.add(seq("C", 6, max_tokens=6, arrival=4.0))
    return core


def test_nobody_waiting_has_no_explanation() -> None:
    core = figure4()
    step(core)
    core.abort("C")
    assert explain(core) is None


def test_figure4_reserve_c_needs_its_reservation_and_b_holds_14_unwritten() -> None:
    why = explain(figure4())
    assert (why.request_id, why.reason, why.worker) == ("C", "kv_reserved", "w0")
    assert why.wait_seconds == 6.0
    assert (why.tokens, why.budget_left) == (6, 7)  # B's decode takes 1 of the 8
    assert (why.positions, why.blocks) == (12, 12)  # reserve: prompt 6 + max_tokens 6
    assert (why.running, why.max_running) == (1, 32)
    [room] = why.workers
    assert (room.free, room.written, room.reserved_unwritten) == (4, 6, 14)
    assert room.holders == [Holder("B", 14)]


def test_figure4_reserve_paged_admits_c_no_budget_or_limit_does_b_finishing_does() -> None:
    why = explain(figure4())
    assert (why.policy, why.other_policy) == ("reserve", "paged")
    assert why.admitted_under_other_policy
    assert why.token_budget is None and why.running_limit is None  # KV is what holds it
    assert why.after == Finisher("B", 13)  # 14 tokens, 1 generated


def test_figure4_paged_the_head_is_admitted_and_reserve_would_not() -> None:
    why = explain(figure4(KvPolicy.PAGED))
    assert why.reason == "" and why.positions == 6 and why.blocks == 6
    assert why.admitted_under_other_policy is False
    assert why.token_budget == 2  # 1 for B's decode, 1 for a first chunk of C
    assert why.running_limit == 2


def test_token_budget_the_smallest_that_admits_without_chunking() -> None:
    why = explain(figure4(KvPolicy.PAGED, token_budget=6, chunked_prefill=False))
    assert (why.reason, why.budget_left, why.tokens) == ("token_budget", 5, 6)
    assert why.token_budget == 7  # B's decode and C's whole prompt
    assert why.after == Finisher("B", 13)


def test_running_limit_the_smallest_that_admits() -> None:
    why = explain(figure4(KvPolicy.PAGED, max_running=1))
    assert (why.reason, why.running, why.max_running) == ("max_running", 1, 1)
    assert why.running_limit == 2
    assert why.token_budget is None  # no budget passes the running limit
    assert why.admitted_under_other_policy is False
    assert why.after == Finisher("B", 13)


def test_explaining_changes_nothing_in_the_core() -> None:
    core, twin = figure4(), figure4()
    explain(core)
    check_invariants(core)
    assert core.snapshot() == twin.snapshot()
    for _ in range(16):
        assert ran(step(core)) == ran(step(twin))
    assert core.snapshot() == twin.snapshot()


def test_after_names_the_finish_that_makes_room_not_merely_the_first() -> None:
    """A (2 + 2) finishes first but frees too little; C (6 + 6) needs B's 20 back."""
    core = Scheduler(
        CoreConfig(token_budget=8, policy=KvPolicy.RESERVE), [WorkerSpec("w0", 30, 1, 4096)]
    )
    core.add(seq("A", 2, max_tokens=2))
    core.add(seq("B", 6, max_tokens=14))
    step(core)
    core.add(seq("C", 6, max_tokens=6))
    why = explain(core)
    assert why.reason == "kv_reserved" and why.workers[0].free == 6
    assert why.after == Finisher("B", 13)


def test_the_reason_is_the_heads_own_not_that_of_a_request_behind_it() -> None:
    core = figure4(KvPolicy.PAGED, max_running=2)
    core.add(seq("D", 2, max_tokens=1))  # stalls on the running limit once C is in
    why = explain(core)
    assert why.request_id == "C" and why.reason == ""
    assert [s.request_id for s in core.waiting] == ["C", "D"]  # the real queue is whole
    check_invariants(core)


class CountingPredictor:
    """A step-time model that counts what it is asked (a real one may refit when asked)."""

    def __init__(self) -> None:
        self.asked = 0

    def predict(self, worker: int, shape) -> float:
        self.asked += 1
        return 0.001


def test_the_counterfactuals_predict_step_times_on_their_own_copy_of_the_model() -> None:
    model = CountingPredictor()
    core = Scheduler(
        CoreConfig(token_budget=8, step_time_budget_ms=50.0),
        [WorkerSpec("w0", 24, 1, 4096)],
        predict=model.predict,
    )
    core.add(seq("B", 6, max_tokens=14))
    step(core)
    core.add(seq("C", 6, max_tokens=6))
    asked = model.asked
    assert asked > 0 and explain(core).request_id == "C"
    assert model.asked == asked  # the copies asked their own


def test_a_time_budget_stall_names_the_smallest_step_time_budget_that_admits() -> None:
    """The seed's B in decode and C waiting, under paged (KV is no limit), with steps that cost
    2 ms + 1 ms a token: B's decode alone is predicted at 3 ms. With a 3 ms budget C waits on
    time; one token of C beside B's decode takes 4 ms, so 4 ms is the smallest budget that
    admits it, and the worker's planned step (B's decode) is predicted at 3 ms."""
    times = FakeTimes(fixed_ms=2.0, token_ms=1.0)
    config = CoreConfig(token_budget=8, policy=KvPolicy.PAGED, step_time_budget_ms=3.0)
    core = Scheduler(config, [WorkerSpec("w0", 24, 1, 4096)], clock=lambda: 10.0, predict=times)
    core.add(seq("B", 6, max_tokens=14, arrival=1.0))
    core.add(seq("C", 6, max_tokens=6, arrival=4.0))
    while not core.seqs["B"].output_ids:  # B's prompt, chunk by chunk: then its decodes begin
        step(core)
    why = explain(core)
    assert (why.request_id, why.reason) == ("C", "time_budget")
    assert why.step_time_budget_ms == 3.0
    assert why.step_predicted_ms == pytest.approx(3.0)
    assert why.time_budget_ms == pytest.approx(4.0)
    assert why.token_budget is None  # no token budget passes the time limit
    core.reconfigure(dataclasses.replace(config, step_time_budget_ms=why.time_budget_ms))
    assert "C" in ran(step(core))  # the answer admits it
    check_invariants(core)


def test_without_a_time_budget_there_is_no_time_counterfactual() -> None:
    why = explain(figure4(KvPolicy.PAGED, token_budget=6, chunked_prefill=False))
    assert why.step_time_budget_ms == 0.0 and why.time_budget_ms is None
    assert why.step_predicted_ms is not None  # the planned step, as the prior predicts it


def test_status_explain_prints_what_the_running_work_takes_of_the_time_budget() -> None:
    """Through the wire form (HeadExplanation) into `llmserve status --explain`'s text."""
    from llmserve.client import explanation_dict
    from llmserve.status_text import explanation_text
    from scheduler_svc.admin import explanation_message

    times = FakeTimes(fixed_ms=2.0, token_ms=1.0)
    config = CoreConfig(token_budget=8, policy=KvPolicy.PAGED, step_time_budget_ms=3.0)
    core = Scheduler(config, [WorkerSpec("w0", 24, 1, 4096)], clock=lambda: 10.0, predict=times)
    core.add(seq("B", 6, max_tokens=14, arrival=1.0))
    core.add(seq("C", 6, max_tokens=6, arrival=4.0))
    while not core.seqs["B"].output_ids:
        step(core)
    e = explanation_dict(explanation_message(explain(core)))
    text = explanation_text({"explanation": e})
    assert "time_budget" in text
    planned = "w0's step as planned, without the head, is predicted at 3.0 ms (100% of the budget)"
    assert "step-time budget 3 ms; " + planned in text
    assert "would admit it: " in text and "step-time budget 4 ms" in text
    untimed = explanation_dict(explanation_message(explain(figure4())))
    assert "step-time budget" not in explanation_text({"explanation": untimed})


def test_under_a_window_the_explanation_gives_the_steps_own_limit() -> None:
    """The budget held over 2 steps: B's decode step (3 ms predicted) leaves the next one 2 x 3
    - 3 = 3 ms, and one token of C beside B's decode takes 4: C waits for time, and the smallest
    budget that admits it is 3.5 ms (2 x 3.5 - 3 = 4)."""
    from llmserve.client import explanation_dict
    from llmserve.status_text import explanation_text
    from scheduler_svc.admin import explanation_message

    times = FakeTimes(fixed_ms=2.0, token_ms=1.0)
    config = CoreConfig(token_budget=8, step_time_budget_ms=3.0, step_time_window=2)
    core = Scheduler(config, [WorkerSpec("w0", 24, 1, 4096)], clock=lambda: 10.0, predict=times)
    core.add(seq("B", 6, max_tokens=14, arrival=1.0))
    core.add(seq("C", 6, max_tokens=6, arrival=4.0))
    while not core.seqs["B"].output_ids:
        step(core)
    step(core)  # a decode step of B: 3 ms
    why = explain(core)
    assert (why.request_id, why.reason) == ("C", "time_budget")
    assert why.step_limit_ms == pytest.approx(3.0) and why.step_time_window == 2
    assert why.time_budget_ms == pytest.approx(3.5)
    text = explanation_text({"explanation": explanation_dict(explanation_message(why))})
    assert "step-time budget 3 ms on average over 2 steps: w0's next step may take 3.0 ms" in text
    core.reconfigure(dataclasses.replace(config, step_time_budget_ms=why.time_budget_ms))
    assert "C" in ran(step(core))
    check_invariants(core)
