"""Overlap: a worker's step N+1 is planned while step N runs, so the core learns tokens and
finishes one step late. These tests pin down exactly how the seed's figures shift, and that
nothing else changes: the same outputs, at most one wasted token per finished request (never
emitted), KV freed."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.config import BatchMode, CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.reasons import StallReason
from scheduler_svc.sequence import Finish
from tests.inproc import run_all
from tests.sim import Overlapped, Recording, check_invariants, seq


def make(capacity: int = 24, **cfg) -> Scheduler:
    return Recording(CoreConfig(**cfg), [WorkerSpec("w0", capacity, 1, 4096)])


def first_step_of(driver: Overlapped, rid: str, limit: int = 10) -> int:
    for n in range(1, limit + 1):
        if rid in driver.step().ran():
            return n
        check_invariants(driver.core)
    raise AssertionError(f"{rid} never ran")


def figure1(mode: BatchMode) -> int:
    """The seed's Figure 1 driven with overlap: A and B in decode, at most 2 running, A's last
    token comes out of execution 1, C arrives then. Returns C's execution, counted as the seed
    counts (execution 2 = the one after A's last)."""
    core = make(capacity=100, max_running=2, mode=mode)
    core.add(seq("A", 3, max_tokens=2))
    core.add(seq("B", 3, max_tokens=4))
    driver = Overlapped(core)
    driver.step()  # prefill of both
    assert driver.step().ran() == {"A": 1, "B": 1}  # execution 1: A's last token is computed
    core.add(seq("C", 3, max_tokens=4))
    return first_step_of(driver, "C") + 1


def test_overlap_continuous_c_joins_one_execution_later_than_the_seed() -> None:
    """Without overlap C runs in execution 2; with it, execution 2 was planned before A's last
    token was known, so A still holds its place: C joins in execution 3."""
    assert figure1(BatchMode.CONTINUOUS) == 3


def test_overlap_static_c_joins_one_execution_later_than_the_seed() -> None:
    assert figure1(BatchMode.STATIC) == 5  # the seed's 4, plus the step learned late


def test_overlap_a_finished_request_computes_at_most_one_token_it_never_emits() -> None:
    """A's end is decided by max_tokens, which the core knows in advance: nothing is wasted.
    B stops on an EOS the core cannot foresee: one more decode was already sent, and its token
    is dropped, never emitted; B's KV is freed at the next step."""
    core = make(capacity=100, max_running=4)
    a = seq("A", 3, max_tokens=3)
    b = seq("B", 3, max_tokens=50, eos_ids=frozenset({7}))
    for s in (a, b):
        core.add(s)
    decodes = {"A": 0, "B": 0}
    inflight = None
    for _ in range(8):
        planned = core.schedule(0)
        check_invariants(core)
        for s in planned.decodes:
            decodes[s.request_id] += 1
        if inflight is not None:  # B's third token is an EOS
            tokens = [
                7 if s is b and len(s.output_ids) == 2 else 5 for s in inflight.sampled_seqs()
            ]
            core.complete(inflight, tokens)
            check_invariants(core)
        inflight = planned
    emitted = [e.token_id for e in core.take_events() if e.request_id == "B" and e.token_id]
    assert a.finish is Finish.LENGTH and a.output_ids == [5, 5, 5]
    assert decodes["A"] == 2  # the prefill samples the 1st token, two decodes the rest
    assert b.finish is Finish.STOP and b.output_ids == [5, 5, 7] and emitted == [5, 5, 7]
    assert decodes["B"] == 3  # one more than the two that produced tokens: the wasted one
    kv = core.snapshot().workers[0]
    assert (kv.running, kv.free) == (0, 100)
    assert core.generated == 6  # the dropped token is not counted


@pytest.mark.parametrize("policy", list(KvPolicy))
@pytest.mark.parametrize("mode", list(BatchMode))
def test_same_outputs_with_and_without_overlap_preemptions_included(policy, mode) -> None:
    """Through the worker's real step session (handles, grants, decodes of its own tokens):
    every request gets the same tokens and finish with overlap on or off, with a roomy or a
    tight pool (preemptions), and every block is free at the end."""
    results = []
    for overlap, capacity in ((False, 400), (True, 400), (False, 14), (True, 14)):
        cfg = CoreConfig(token_budget=7, max_running=4, policy=policy, mode=mode)
        specs = [WorkerSpec("w0", capacity, 2, 64), WorkerSpec("w1", capacity, 3, 64)]
        core = Recording(cfg, specs)
        rng = random.Random(2)
        seqs = [seq(f"r{i}", rng.randint(1, 12), rng.randint(1, 12)) for i in range(25)]
        for s in seqs:
            core.add(s)
        run_all(core, overlap)
        results.append({s.request_id: (s.finish, list(s.output_ids)) for s in seqs})
        assert all(ws.kv.pool.num_free == ws.spec.num_blocks for ws in core.workers)
        if capacity == 14 and policy is KvPolicy.PAGED:
            assert core.preemptions > 0
    assert all(r == results[0] for r in results)
    assert all(finish is Finish.LENGTH for finish, _ in results[0].values())


def test_overlap_static_nothing_joins_a_batch_planned_before_its_first_token() -> None:
    """Static batching adds no request to a batch once it has started. A and B start together,
    the running limit leaves room; C arrives; step 2 is planned before step 1 (the batch's
    first tokens) has completed: C still waits, until A and B have both left."""
    core = make(capacity=100, max_running=4, mode=BatchMode.STATIC)
    core.add(seq("A", 3, max_tokens=2))
    core.add(seq("B", 3, max_tokens=4))
    driver = Overlapped(core)
    assert driver.step().ran() == {"A": 3, "B": 3}
    core.add(seq("C", 3, max_tokens=2))
    c = core.seqs["C"]
    for _ in range(20):
        ran = driver.step().ran()
        check_invariants(core)
        if "C" in ran:
            break
        assert c.worker is None and core.head_reason is StallReason.STATIC_BATCH
    else:
        raise AssertionError("C never ran")
    assert ran == {"C": 3}  # the batch of A and B had drained
    assert all(s.is_finished for s in (core.seqs.get("A"), core.seqs.get("B")) if s)
