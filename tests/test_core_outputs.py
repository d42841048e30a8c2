"""What the core's calls return, read directly (no outbox): a planned step's admissions and
failures, complete's tokens and finishes, the finishes of abort and the failure paths."""

from __future__ import annotations

import pytest

from scheduler_svc.config import CoreConfig, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.invariants import check_invariants
from scheduler_svc.output import Event, Outputs, StepTokens
from scheduler_svc.sequence import Finish, Sequence
from tests.sim import ids, seq


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_step_carries_its_first_admissions_with_queue_time_and_cached_tokens() -> None:
    clock = Clock()
    core = Scheduler(CoreConfig(), [WorkerSpec("w0", 100, 4, 4096)], clock=clock)
    core.add(seq("a", 4, 3))
    clock.now = 2.5
    [planned] = core.schedule_all()
    assert planned.admissions == [Event("a", admitted=True, queue_time=2.5, cached_tokens=0)]
    assert planned.failed == []
    core.fail_worker(0)
    core.restore_worker(0)
    [again] = core.schedule_all()
    assert again.admissions == []  # admitted before: its queue time ended then


def test_complete_returns_every_sampled_token_and_the_finishes() -> None:
    core = Scheduler(CoreConfig(), [WorkerSpec("w0", 100, 4, 4096)])
    core.add(seq("a", 4, 2))
    core.add(seq("b", 4, 1))
    [first] = core.schedule_all()
    out = core.complete(first, [11, 12])  # both prompts sample their first token
    assert type(out) is Outputs and type(out.tokens) is StepTokens
    assert list(out.tokens) == [("a", 11), ("b", 12)]
    assert [(e.request_id, e.finish) for e in out.finishes] == [("b", Finish.LENGTH)]
    [second] = core.schedule_all()
    out = core.complete(second, [13])  # a decodes
    assert list(out.tokens) == [("a", 13)] and ids(out.finishes) == ["a"]
    assert out.admissions == [] and [e.token_id for e in out.events()] == [13, None]
    assert core.generated == 3


def test_a_token_dropped_since_the_plan_is_not_returned() -> None:
    core = Scheduler(CoreConfig(), [WorkerSpec("w0", 100, 4, 4096)])
    for rid in "ab":
        core.add(seq(rid, 4, 5))
    [first] = core.schedule_all()
    core.complete(first, [11, 12])
    [planned] = core.schedule_all()
    assert ids(core.abort("a")) == ["a"] and core.abort("a") == []  # one finish, once
    out = core.complete(planned, [21, 22])
    assert list(out.tokens) == [("b", 22)] and out.finishes == [] and core.generated == 3


def test_the_failure_paths_return_the_finishes_they_make() -> None:
    core = Scheduler(CoreConfig(), [WorkerSpec("w0", 100, 4, 4096)])
    for rid in "abc":
        core.add(seq(rid, 4, 5))
    [first] = core.schedule_all()
    core.complete(first, [1, 2, 3])
    [planned] = core.schedule_all()
    a, b, c = planned.decodes
    failed = core.fail_items(planned, {a.handle: "bad token"}, "w0")
    assert [(e.request_id, e.finish) for e in failed] == [("a", Finish.ERROR)]
    assert "bad token" in failed[0].error
    assert ids(core.fail_step(planned, "the model failed")) == ["b", "c"]


def test_a_decode_run_whose_every_decode_failed_completes_empty() -> None:
    # the service's order when the worker fails a run's only request alone: fail_items, then
    # complete with no tokens (it had raised, and the scheduler exited 70)
    core = Scheduler(
        CoreConfig(decode_steps=4, decode_runs="fixed"), [WorkerSpec("w0", 100, 4, 4096)]
    )
    core.add(seq("a", 4, 20))
    core.add(seq("b", 4, 20))
    [first] = core.schedule_all()
    core.complete(first, [1, 2])
    [run] = core.schedule_all()
    assert run.repeat > 1 and len(run.decodes) == 2
    failed = core.fail_items(run, {s.handle: "boom" for s in run.decodes}, "w0")
    assert sorted(ids(failed)) == ["a", "b"]
    out = core.complete(run, [])
    assert out.tokens is not None and list(out.tokens) == [] and out.finishes == []
    core.add(seq("c", 4, 2))  # the core goes on, the failed requests gone and their KV free
    [next_step] = core.schedule_all()
    assert ids(next_step.admissions) == ["c"]
    assert [s.request_id for s in core.workers[0].running] == ["c"]
    check_invariants(core)


def test_a_request_no_live_worker_can_hold_fails_on_the_first_step_planned() -> None:
    core = Scheduler(CoreConfig(), [WorkerSpec("w0", 4, 4, 64), WorkerSpec("w1", 100, 4, 4096)])
    core.add(seq("long", 40, 5))  # only w1 can hold it
    core.fail_worker(1)
    steps = core.schedule_workers([0])
    assert [(e.request_id, e.finish) for e in steps[0].failed] == [("long", Finish.ERROR)]
    assert "failed or draining" in steps[0].failed[0].error
    assert not core.waiting and core.fail_unplaceable() == []
    core.restore_worker(1)
    core.add(seq("long2", 40, 5))
    core.fail_worker(1)
    [only] = core.schedule_all()  # lock-step: a step with nothing but a failure is returned
    assert ids(only.failed) == ["long2"] and not only.has_work


def test_the_core_refuses_an_empty_prompt_or_no_tokens_to_generate() -> None:
    # a library user's request the service's door would refuse: an empty prompt had become a
    # head that stalled the queue for good, and max_tokens 0 had generated a token
    core = Scheduler(CoreConfig(), [WorkerSpec("w0", 100, 4, 4096)])
    for bad in (Sequence("empty", [], 5), Sequence("none", [1, 2], 0)):
        with pytest.raises(ValueError, match=bad.request_id):
            core.add(bad)
    assert not core.waiting and not core.seqs
