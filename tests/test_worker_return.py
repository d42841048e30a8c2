"""Requests that only failed workers can hold wait a bounded time (`return_wait`, the
scheduler's --worker-return-timeout) for one to come back instead of failing at once: a scheduler
resumed after a stall that broke every worker's stream, or the one worker restarted, loses
nothing. Drained and departed workers are not waited for; past the bound they fail as before."""

from __future__ import annotations

import pytest

from scheduler_svc.config import CoreConfig, WorkerSpec
from scheduler_svc.output import Refused
from scheduler_svc.reasons import StallReason
from scheduler_svc.sequence import Finish
from tests.sim import Recording, check_invariants, ids, seq, step


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def core_of(*specs: WorkerSpec, wait: float = 30.0) -> tuple[Recording, Clock]:
    clock = Clock()
    core = Recording(CoreConfig(), list(specs), clock=clock)
    core.return_wait = wait
    return core, clock


def errors(core: Recording) -> dict[str, str]:
    return {e.request_id: e.error for e in core.take_events() if e.finish is Finish.ERROR}


def test_requests_wait_for_the_one_failed_worker_and_finish_whole_when_it_is_back() -> None:
    core, clock = core_of(WorkerSpec("w0", 50, 4, 4096))
    core.add(seq("a", 5, 8))
    core.add(seq("b", 5, 8))
    for _ in range(3):
        step(core)
    core.fail_worker(0)  # both running: back to the queue, nobody live
    clock.now += 29.0
    assert core.fail_unplaceable() == []
    core.add(seq("c", 5, 8))  # a new request is queued, not refused, while it may come back
    assert [s.request_id for s in core.waiting] == ["a", "b", "c"]
    assert errors(core) == {}
    core.restore_worker(0)
    for _ in range(30):
        step(core)
    assert {r: len(core.seqs[r].output_ids) for r in core.seqs} == {}  # all finished and left
    finished = [e for e in core.take_events() if e.finish]
    assert sorted((e.request_id, e.finish) for e in finished) == [
        ("a", Finish.LENGTH), ("b", Finish.LENGTH), ("c", Finish.LENGTH)
    ]  # fmt: skip
    check_invariants(core)


def test_past_the_bound_the_waiting_requests_fail_and_new_ones_are_refused() -> None:
    core, clock = core_of(WorkerSpec("w0", 50, 4, 4096))
    core.add(seq("a", 5, 8))
    step(core)
    core.fail_worker(0)
    clock.now += 30.0
    assert ids(core.fail_unplaceable()) == ["a"]
    assert errors(core) == {
        "a": "no live worker can hold this request (the workers that could are failed or "
        "draining, none back within 30 s; 0 live); retry"
    }
    with pytest.raises(Refused, match="no live worker"):
        core.add(seq("b", 5, 8))
    assert not core.waiting and not core.seqs


def test_with_no_wait_they_fail_at_once() -> None:
    core, _ = core_of(WorkerSpec("w0", 50, 4, 4096), wait=0.0)
    core.add(seq("a", 5, 8))
    core.fail_worker(0)
    assert ids(core.fail_unplaceable()) == ["a"]


def test_a_draining_or_departed_worker_is_not_waited_for() -> None:
    core, _ = core_of(WorkerSpec("w0", 50, 4, 4096), WorkerSpec("w1", 50, 4, 4096))
    core.add(seq("a", 5, 8))
    core.drain_worker(0)
    core.remove_worker(1)
    assert ids(core.fail_unplaceable()) == ["a"]


def test_a_second_failure_does_not_restart_the_wait() -> None:
    core, clock = core_of(WorkerSpec("w0", 50, 4, 4096))
    core.add(seq("a", 5, 8))
    core.fail_worker(0)
    clock.now += 20.0
    core.fail_worker(0)  # failed again before it came back: still down since the first
    clock.now += 10.0
    assert ids(core.fail_unplaceable()) == ["a"]


def test_a_head_only_a_failed_worker_can_hold_waits_for_it_as_a_stall() -> None:
    """w1 is live but too small for the head: the head stalls (worker_down) on w0 rather than
    fail; it is admitted on w0 once w0 is back."""
    core, clock = core_of(WorkerSpec("big", 50, 4, 4096), WorkerSpec("small", 50, 1, 16))
    core.fail_worker(0)
    core.add(seq("long", 30, 5))  # only "big" holds 35 positions
    core.schedule(1)
    assert core.snapshot().head_wait_reason == StallReason.WORKER_DOWN
    assert core.stalls[StallReason.WORKER_DOWN] == 1 and errors(core) == {}
    core.restore_worker(0)
    core.schedule(0)
    assert [s.request_id for s in core.workers[0].running] == ["long"]
    clock.now += 60.0  # back in time: nothing fails
    assert core.fail_unplaceable() == []


def test_a_wait_under_a_second_holds_and_ends_as_set() -> None:
    core, clock = core_of(WorkerSpec("w0", 50, 4, 4096), wait=0.5)
    core.add(seq("a", 5, 8))
    core.fail_worker(0)
    clock.now += 0.4
    assert core.fail_unplaceable() == []
    clock.now += 0.1
    assert ids(core.fail_unplaceable()) == ["a"]
    assert "none back within 0.5 s" in errors(core)["a"]


def test_a_worker_back_and_failed_again_gets_a_new_wait() -> None:
    core, clock = core_of(WorkerSpec("w0", 50, 4, 4096))
    core.fail_worker(0)
    clock.now += 25.0
    core.restore_worker(0)
    core.add(seq("a", 5, 8))
    clock.now += 10.0
    core.fail_worker(0)  # 35 s after the first failure, 0 s after this one
    clock.now += 29.0
    assert core.fail_unplaceable() == [] and errors(core) == {}


def test_a_failed_worker_that_leaves_for_good_is_no_longer_waited_for() -> None:
    """Failed (its requests wait), then forgotten (a registered worker away too long): they
    fail at once."""
    core, _ = core_of(WorkerSpec("w0", 50, 4, 4096))
    core.add(seq("a", 5, 8))
    step(core)
    core.fail_worker(0)
    assert core.fail_unplaceable() == []
    core.remove_worker(0)
    assert ids(core.fail_unplaceable()) == ["a"]
    assert errors(core) == {"a": "no worker can hold this request (0 live); retry"}
