"""Placement over workers that differ, strict FCFS across the one queue, and workers that join
and leave while requests run."""

from __future__ import annotations

from scheduler_svc.config import CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.messages import step_message
from tests.inproc import run_all
from tests.sim import check_invariants, ids, ran, seq, step


def placed(core: Scheduler) -> dict[str, str]:
    return {s.request_id: ws.spec.name for ws in core.workers for s in ws.running}


def test_placement_compares_free_positions_not_blocks() -> None:
    """100 free blocks of 1 position lose to 20 free blocks of 16 (320 positions)."""
    core = Scheduler(
        CoreConfig(), [WorkerSpec("small", 100, 1, 4096), WorkerSpec("big", 20, 16, 4096)]
    )
    core.add(seq("a", 10, 5))
    step(core)
    assert placed(core) == {"a": "big"}


def test_a_prompt_too_long_for_one_workers_context_goes_to_one_that_fits() -> None:
    core = Scheduler(
        CoreConfig(),
        [WorkerSpec("short", 1000, 1, 64), WorkerSpec("long", 200, 1, 512)],  # short: more KV
    )
    core.add(seq("long-prompt", 100, 5))
    core.add(seq("fits-both", 10, 5))
    step(core)
    assert placed(core) == {"long-prompt": "long", "fits-both": "short"}
    check_invariants(core)


def test_a_worker_whose_context_would_cut_the_request_short_is_not_preferred() -> None:
    """prompt + max_tokens = 100: the worker of context 64 would end it early, so the one of
    context 4096 takes it although it has fewer free positions."""
    core = Scheduler(
        CoreConfig(), [WorkerSpec("short", 1000, 1, 64), WorkerSpec("long", 200, 1, 4096)]
    )
    core.add(seq("r", 20, 80))
    step(core)
    assert placed(core) == {"r": "long"}


def test_strict_fcfs_a_blocked_head_is_not_overtaken_by_a_smaller_request() -> None:
    """KV for 24 positions; B holds 20 (reserve). C needs 12 and waits; D needs 3 and would fit,
    but may not overtake C."""
    core = Scheduler(
        CoreConfig(policy=KvPolicy.RESERVE, token_budget=64), [WorkerSpec("w", 24, 1, 4096)]
    )
    core.add(seq("B", 6, max_tokens=14))
    step(core)
    core.add(seq("C", 6, max_tokens=6))
    core.add(seq("D", 1, max_tokens=2))
    for _ in range(3):
        assert set(ran(step(core))) == {"B"}
    assert [s.request_id for s in core.waiting] == ["C", "D"]
    assert core.snapshot().head_wait_reason == "kv_reserved"


def test_a_preempted_request_returns_to_the_front_of_the_queue() -> None:
    core = Scheduler(CoreConfig(token_budget=64, max_running=2), [WorkerSpec("w", 8, 2, 4096)])
    core.add(seq("old", 4, 10))
    core.add(seq("new", 4, 10))
    step(core)
    core.add(seq("late", 2, 2))
    while not core.preemptions:
        step(core)
    assert [s.request_id for s in core.waiting][:2] == ["new", "late"]


def test_a_joining_worker_takes_admissions_at_once() -> None:
    core = Scheduler(CoreConfig(max_running=2), [WorkerSpec("w0", 100, 4, 4096)])
    for i in range(4):
        core.add(seq(f"r{i}", 4, 30))
    step(core)
    assert len(core.waiting) == 2 and core.snapshot().head_wait_reason == "max_running"
    index = core.add_worker(WorkerSpec("w1", 50, 8, 4096))  # another pool size: welcome
    step(core)
    assert sorted(r for r, w in placed(core).items() if w == "w1") == ["r2", "r3"]
    assert index == 1 and not core.waiting
    check_invariants(core)


def test_a_head_placed_on_another_worker_wakes_that_worker_and_stops_this_one() -> None:
    """Per-worker loops: w0 plans while the head's place is on w1 (more free KV): w0 admits
    nothing (FCFS) and asks for w1; w1's own step admits it."""
    core = Scheduler(CoreConfig(), [WorkerSpec("w0", 40, 1, 4096), WorkerSpec("w1", 80, 1, 4096)])
    core.add(seq("a", 5, 5))
    core.add(seq("b", 5, 5))
    assert core.schedule(0).ran() == {}
    assert core.take_wakes() == {1}
    assert core.schedule(1).ran() == {"a": 5, "b": 5}


def test_a_removed_worker_requeues_its_requests_and_leaves_the_snapshot() -> None:
    core = Scheduler(CoreConfig(), [WorkerSpec("w0", 100, 4, 4096), WorkerSpec("w1", 90, 4, 4096)])
    core.add(seq("a", 4, 30))
    step(core)
    assert placed(core) == {"a": "w0"}
    core.remove_worker(0)
    assert [w.name for w in core.snapshot().workers] == ["w1"]
    step(core)
    assert placed(core) == {"a": "w1"}
    check_invariants(core)


def test_step_messages_carry_only_changes_not_contexts() -> None:
    """Decodes are handles: the message of a decode step does not grow with the context (it
    repeats with the block size: a grant of one block each time a request fills one)."""
    core = Scheduler(CoreConfig(token_budget=4096), [WorkerSpec("w", 4096, 16, 8192)])
    for i in range(32):
        core.add(seq(f"r{i}", 200, 1000))
    sizes = []
    for _ in range(40):
        s = core.schedule_all()[0]
        sizes.append(step_message(core.steps, s).ByteSize())
        core.complete(s, [5] * s.num_sampled)
    assert sizes[0] > 32 * 200  # the prompts go once
    assert max(sizes[5:]) < 32 * 8
    assert sizes[5:21] == sizes[21:37]


def test_workers_of_different_block_sizes_and_contexts_serve_a_mixed_load() -> None:
    specs = [WorkerSpec("a", 60, 1, 48), WorkerSpec("b", 12, 8, 200), WorkerSpec("c", 30, 3, 96)]
    core = Scheduler(CoreConfig(token_budget=16, max_running=3), specs)
    seqs = [seq(f"r{i}", 5 + (i * 7) % 60, 4 + i % 9) for i in range(18)]
    for s in seqs:
        core.add(s)
    run_all(core, overlap=True)
    assert all(s.is_finished and s.output_ids for s in seqs)
    assert all(ws.kv.pool.num_free == ws.spec.num_blocks for ws in core.workers)


def test_refused_when_no_single_worker_holds_it_though_two_together_would() -> None:
    """Context from one worker and KV from another do not add up: refused at once."""
    from scheduler_svc.output import Refused

    core = Scheduler(
        CoreConfig(), [WorkerSpec("long", 10, 1, 4096), WorkerSpec("big", 1000, 1, 64)]
    )
    try:
        core.add(seq("r", 100, 20))  # context: only "long" (10 positions of KV)
    except Refused as err:
        assert err.reason == "kv_capacity"
    else:
        raise AssertionError("accepted a request no worker can hold")


def test_a_request_only_a_failed_worker_can_hold_fails_at_once_and_the_rest_still_run() -> None:
    """Waiting for a worker that may never return left clients hanging with no reason given:
    the request fails (the gateway answers UNAVAILABLE) and the queue behind it moves on."""
    from scheduler_svc.sequence import Finish

    core = Scheduler(
        CoreConfig(), [WorkerSpec("long", 200, 1, 4096), WorkerSpec("short", 200, 1, 64)]
    )
    long, short = seq("long-prompt", 100, 5), seq("short-prompt", 10, 5)
    core.add(long)
    core.add(short)
    core.fail_worker(0)
    step(core)
    assert long.finish is Finish.ERROR and "failed or draining" in long.error
    assert placed(core) == {"short-prompt": "short"} and not core.waiting


def test_a_request_only_a_draining_worker_could_hold_fails_when_the_drain_starts() -> None:
    from scheduler_svc.sequence import Finish

    core = Scheduler(
        CoreConfig(), [WorkerSpec("long", 200, 1, 4096), WorkerSpec("short", 200, 1, 64)]
    )
    r = seq("r", 100, 5)
    core.add(r)
    core.drain_worker(0)
    assert ids(core.fail_unplaceable()) == ["r"]
    assert r.finish is Finish.ERROR and not core.waiting and "r" not in core.seqs


def test_fail_unplaceable_keeps_what_a_live_worker_can_hold() -> None:
    core = Scheduler(
        CoreConfig(), [WorkerSpec("long", 200, 1, 4096), WorkerSpec("short", 200, 1, 64)]
    )
    core.add(seq("long-prompt", 100, 5))
    core.add(seq("short-prompt", 10, 5))
    core.fail_worker(0)
    assert ids(core.fail_unplaceable()) == ["long-prompt"]
    assert [s.request_id for s in core.waiting] == ["short-prompt"]


def test_a_request_no_worker_left_can_hold_ends_with_an_error() -> None:
    from scheduler_svc.sequence import Finish

    core = Scheduler(
        CoreConfig(), [WorkerSpec("long", 200, 1, 4096), WorkerSpec("short", 200, 1, 64)]
    )
    r = seq("r", 100, 5)
    core.add(r)
    core.remove_worker(0)
    step(core)
    assert r.finish is Finish.ERROR and "no worker" in r.error and not core.waiting
