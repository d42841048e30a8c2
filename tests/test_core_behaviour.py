"""Scheduler core behaviour beyond the figures: preemption, chunking, cancel, refusal, workers."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.config import BatchMode, CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.output import Refused
from scheduler_svc.sequence import Finish, Sequence
from tests.sim import Recording, check_invariants, ran, seq, step


def run_to_end(
    core: Scheduler, seqs: list[Sequence] | None = None, limit: int = 2000
) -> dict[str, list[int]]:
    """Run until idle; the outputs of `seqs` (default: every request the core holds now)."""
    live = list(core.seqs.values()) if seqs is None else seqs
    for _ in range(limit):
        if not core.waiting and not any(ws.running for ws in core.workers):
            break
        step(core)
        check_invariants(core)
    return {s.request_id: list(s.output_ids) for s in live}


def workload(core: Scheduler, n: int = 12, seed: int = 1) -> list[Sequence]:
    rng = random.Random(seed)
    seqs = [seq(f"r{i}", rng.randint(1, 20), rng.randint(1, 30)) for i in range(n)]
    for s in seqs:
        core.add(s)
    return seqs


def test_preemption_loses_nothing_outputs_identical() -> None:
    """The fake model's output does not depend on who was preempted, so the outputs alone cannot
    tell a wrong victim: the oldest running request (r0, which fits alone) is never one, and the
    preemptions the events report are the core's."""
    roomy = Recording(CoreConfig(token_budget=16, max_running=8), [WorkerSpec("w", 1000, 4, 4096)])
    tight = Recording(CoreConfig(token_budget=16, max_running=8), [WorkerSpec("w", 14, 4, 4096)])
    expected = run_to_end(roomy, workload(roomy))
    seqs = workload(tight)
    got = run_to_end(tight, seqs)
    assert tight.preemptions > 0 and roomy.preemptions == 0
    assert got == expected
    assert all(len(v) == s.max_tokens for s, v in zip(seqs, got.values(), strict=True))
    assert seqs[0].preemptions == 0
    reported = {e.request_id: e.preemptions for e in tight.take_events() if e.finish}
    assert reported == {s.request_id: s.preemptions for s in seqs}
    assert sum(reported.values()) == tight.preemptions


def test_chunked_prefill_gives_the_same_output_as_one_shot() -> None:
    chunked = Recording(CoreConfig(token_budget=5), [WorkerSpec("w", 500, 2, 4096)])
    oneshot = Recording(CoreConfig(token_budget=64), [WorkerSpec("w", 500, 2, 4096)])
    requests = {}
    for name, core in (("chunked", chunked), ("oneshot", oneshot)):
        requests[name] = [seq("long", 23, 6), seq("short", 3, 9)]
        for s in requests[name]:
            core.add(s)
    assert ran(step(chunked)) == {"long": 5}  # the prompt goes in chunks within the budget
    assert run_to_end(chunked, requests["chunked"]) == run_to_end(oneshot, requests["oneshot"])


def test_cancel_frees_kv_at_the_next_step() -> None:
    core = Recording(CoreConfig(), [WorkerSpec("w", 16, 4, 4096)])  # 64 positions
    core.add(seq("a", 10, 50))
    core.add(seq("b", 10, 50))
    step(core)
    assert core.snapshot().workers[0].free < 64
    assert core.abort("a") and core.abort("b")
    core.schedule_all()
    kv = core.snapshot().workers[0]
    assert (kv.written, kv.reserved_unwritten, kv.free) == (0, 0, 64)
    finishes = [e.finish for e in core.take_events() if e.finish]
    assert finishes == [Finish.CANCELLED, Finish.CANCELLED]


def test_cancel_while_waiting_removes_it_from_the_queue() -> None:
    core = Recording(CoreConfig(max_running=1), [WorkerSpec("w", 64, 4, 4096)])
    core.add(seq("a", 4, 50))
    core.add(seq("b", 4, 50))
    step(core)
    assert core.abort("b") and not core.abort("b")
    assert core.snapshot().waiting == 0


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "reason"),
    [(100, 1, "context"), (30, 40, "kv_capacity")],
)
def test_a_request_that_can_never_run_is_refused_at_once(prompt, max_tokens, reason) -> None:
    core = Recording(CoreConfig(), [WorkerSpec("w", 16, 4, 100)])  # 64 positions, context 100
    with pytest.raises(Refused) as err:
        core.add(seq("x", prompt, max_tokens))
    assert err.value.reason == reason and str(err.value)
    assert core.snapshot().refused == {reason: 1}


def test_duplicate_request_id_is_refused() -> None:
    core = Recording(CoreConfig(), [WorkerSpec("w", 16, 4, 100)])
    core.add(seq("x", 3, 3))
    with pytest.raises(Refused, match="already in flight"):
        core.add(seq("x", 3, 3))


def test_a_cancelled_running_id_is_refused_saying_it_frees_at_the_next_step() -> None:
    """Its KV (and id) are freed at its worker's next step; until then a resubmission is told
    so, not that the id is in flight."""
    core = Recording(CoreConfig(), [WorkerSpec("w", 16, 4, 100)])
    core.add(seq("x", 3, 5))
    step(core)
    core.abort("x")
    with pytest.raises(Refused, match="'x' has ended; its KV is freed at its worker's next step"):
        core.add(seq("x", 3, 5))
    step(core)
    core.add(seq("x", 3, 5))  # the id is free again
    assert core.seqs["x"].output_ids == []


def test_requests_go_to_the_worker_with_the_most_free_kv() -> None:
    core = Recording(CoreConfig(), [WorkerSpec("w0", 40, 1, 4096), WorkerSpec("w1", 40, 1, 4096)])
    core.add(seq("a", 20, 5))
    step(core)
    core.add(seq("b", 5, 5))
    core.add(seq("c", 5, 5))
    step(core)
    where = {s.request_id: s.worker for ws in core.workers for s in ws.running}
    assert where["a"] != where["b"]
    assert where["c"] == where["b"]  # 40-6 > 40-21 after b


def test_failed_worker_requeues_its_requests_and_outputs_match() -> None:
    specs = [WorkerSpec("w0", 200, 4, 4096), WorkerSpec("w1", 200, 4, 4096)]
    steady, failing = Recording(CoreConfig(), specs), Recording(CoreConfig(), specs)
    steady_seqs, failing_seqs = (workload(core, n=6, seed=3) for core in (steady, failing))
    for _ in range(4):
        step(failing)
    moved = failing.fail_worker(0)
    assert moved and all(s.worker is None for s in moved)
    assert run_to_end(failing, failing_seqs) == run_to_end(steady, steady_seqs)


@pytest.mark.parametrize("policy", list(KvPolicy))
@pytest.mark.parametrize("mode", list(BatchMode))
def test_random_workloads_keep_invariants_and_finish_everything(policy, mode) -> None:
    for trial in range(5):
        cfg = CoreConfig(token_budget=12, max_running=5, policy=policy, mode=mode)
        core = Recording(cfg, [WorkerSpec("w0", 20, 2, 64), WorkerSpec("w1", 12, 3, 64)])
        rng = random.Random(trial)
        for i in range(15):
            p, m = rng.randint(1, 12), rng.randint(1, 12)
            core.add(seq(f"t{trial}-{i}", p, m))
        outs = run_to_end(core)
        assert all(len(o) > 0 for o in outs.values())
        for ws in core.workers:
            assert ws.kv.pool.num_free == ws.spec.num_blocks and not ws.running


def test_static_batch_forms_whole_then_admits_nothing_until_it_drains() -> None:
    cfg = CoreConfig(token_budget=8, max_running=4, mode=BatchMode.STATIC)
    core = Recording(cfg, [WorkerSpec("w", 200, 1, 4096)])
    for i in range(4):
        core.add(seq(f"s{i}", 6, max_tokens=3 + i))
    assert ran(step(core)) == {f"s{i}": 6 for i in range(4)}  # one prefill of 24 tokens
    core.add(seq("late", 2, max_tokens=2))
    executions = 1
    while "late" not in ran(step(core)):
        executions += 1
        assert core.snapshot().head_wait_reason == "static_batch"
    assert executions == 6  # s3 ran 6 executions (3 + 3 tokens) before the batch drained
