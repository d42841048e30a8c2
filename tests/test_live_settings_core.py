"""Settings changed live on the core: each applies from the next plan, keeps every invariant and
loses, repeats or changes no request's tokens."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.config import BatchMode, CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.sequence import Finish
from tests.inproc import InProcessWorker
from tests.sim import check_invariants, ran, seq, step


def figure4(policy: KvPolicy) -> Scheduler:
    """The seed's Figure 4: B (6 + 14 reserved under reserve) decodes, C (6 + 6) waits."""
    core = Scheduler(CoreConfig(token_budget=8, policy=policy), [WorkerSpec("w0", 24, 1, 4096)])
    core.add(seq("B", 6, max_tokens=14))
    step(core)
    core.add(seq("C", 6, max_tokens=6))
    return core


def test_reserve_to_paged_releases_the_unwritten_reservation_at_once_and_admits_c() -> None:
    core = figure4(KvPolicy.RESERVE)
    assert "C" not in ran(step(core))  # kv_reserved
    core.reconfigure(dataclasses.replace(core.config, policy=KvPolicy.PAGED))
    kv = core.snapshot().workers[0]
    assert (kv.written, kv.reserved_unwritten, kv.free) == (7, 0, 17)  # B keeps what it wrote
    check_invariants(core)
    [planned] = core.schedule_all()
    assert [s.request_id for s in planned.added] == ["C"]
    assert planned.trims == [(core.seqs["B"].handle, 7)]  # the worker drops the rest
    check_invariants(core)


def test_a_request_released_before_its_trim_is_sent_gets_no_trim() -> None:
    core = figure4(KvPolicy.RESERVE)
    core.reconfigure(dataclasses.replace(core.config, policy=KvPolicy.PAGED))
    handle = core.seqs["B"].handle
    core.abort("B")  # the worker forgets B with the release: a trim would name an unknown handle
    [planned] = core.schedule_all()
    assert handle in planned.released and planned.trims == []
    check_invariants(core)


def test_paged_to_reserve_running_requests_keep_growing_and_a_reservation_waits_for_room() -> None:
    """A, admitted under paged, may grow to 20 of 24 positions; under reserve C (4 + 4) would
    fit in the free blocks now but not beside A's growth: it waits (kv_reserved) until A ends,
    and nobody is preempted."""
    core = Scheduler(CoreConfig(token_budget=8), [WorkerSpec("w0", 24, 1, 4096)])
    core.add(seq("A", 4, max_tokens=16))
    step(core)
    core.reconfigure(dataclasses.replace(core.config, policy=KvPolicy.RESERVE))
    core.add(seq("C", 4, max_tokens=4))
    waited = 0
    while "C" not in ran(step(core)):
        assert core.snapshot().head_wait_reason == "kv_reserved"
        check_invariants(core)
        waited += 1
    assert core.seqs.get("A") is None and waited == 15  # A's last 15 tokens
    while core.seqs:
        step(core)
    assert core.preemptions == 0


def test_a_change_that_would_strand_a_waiting_prompt_is_refused_and_changes_nothing() -> None:
    core = Scheduler(CoreConfig(token_budget=8), [WorkerSpec("w0", 100, 1, 4096)])
    core.add(seq("A", 12, max_tokens=2))
    before = core.config
    with pytest.raises(ValueError, match="token_budget"):
        core.reconfigure(dataclasses.replace(before, chunked_prefill=False))
    assert core.config is before and core.chunked and not core.setting_changes
    assert ran(step(core)) == {"A": 8}


def test_caching_off_forgets_the_cache_and_counts_the_change() -> None:
    core = Scheduler(CoreConfig(token_budget=64), [WorkerSpec("w0", 64, 4, 4096)])
    core.add(seq("A", 16, max_tokens=1))
    while core.seqs:
        step(core)
    assert core.snapshot().workers[0].cached_blocks > 0
    core.reconfigure(dataclasses.replace(core.config, prefix_caching=False))
    kv = core.snapshot().workers[0]
    assert (kv.cached_blocks, kv.evictable_blocks, kv.free) == (0, 0, 256)
    assert core.setting_changes == {"prefix_caching": 1}
    check_invariants(core)


CHANGES = st.one_of(
    st.builds(lambda v: {"policy": v}, st.sampled_from(list(KvPolicy))),
    st.builds(lambda v: {"mode": v}, st.sampled_from(list(BatchMode))),
    st.builds(lambda v: {"token_budget": v}, st.integers(1, 16)),
    st.builds(lambda v: {"max_running": v}, st.integers(1, 5)),
    st.builds(lambda v: {"chunked_prefill": v}, st.booleans()),
    st.builds(lambda v: {"prefix_caching": v}, st.booleans()),
)


def run(changes: list[tuple[int, dict]], seed: int, overlap: bool) -> dict:
    """A random workload on two workers' real step sessions, `changes` applied at their ticks.
    Every step's invariants are checked (InProcessWorker)."""
    cfg = CoreConfig(token_budget=7, max_running=4, policy=KvPolicy.RESERVE)
    core = Scheduler(cfg, [WorkerSpec("w0", 40, 2, 64), WorkerSpec("w1", 30, 3, 64)])
    rng = random.Random(seed)
    seqs = [seq(f"r{i}", rng.randint(1, 12), rng.randint(1, 12)) for i in range(16)]
    for s in seqs:
        core.add(s)
    workers = [InProcessWorker(core, i, overlap) for i in range(2)]
    pending = sorted(changes, key=lambda c: c[0])
    for tick in range(5000):
        while pending and pending[0][0] <= tick:
            change = pending.pop(0)[1]
            before = core.config
            try:
                core.reconfigure(dataclasses.replace(before, **change))
            except ValueError:
                assert core.config is before  # refused: nothing changed
            check_invariants(core)
        if not any([w.tick() for w in workers]) and not core.waiting and not pending:
            break
    assert not core.seqs, "a request was lost"
    assert all(ws.kv.pool.num_free == ws.spec.num_blocks for ws in core.workers)
    return {s.request_id: (s.finish, list(s.output_ids)) for s in seqs}


@pytest.mark.search
@settings(max_examples=40, deadline=None)
@given(
    changes=st.lists(st.tuples(st.integers(0, 120), CHANGES), max_size=8),
    seed=st.integers(0, 3),
    overlap=st.booleans(),
)
def test_any_sequence_of_changes_keeps_every_invariant_and_every_output(
    changes, seed, overlap
) -> None:
    outputs = run(changes, seed, overlap)
    assert outputs == run([], seed, overlap)
    assert all(finish is Finish.LENGTH for finish, _ in outputs.values())


def test_reserve_to_paged_leaves_a_request_finished_since_its_last_step_to_its_release() -> None:
    """Found by the property test (seed 1, overlap, paged at tick 29): a request that finished
    in the step just completed is still among the running until its worker plans again; the
    switch must not trim it (its handle is gone: the worker's message cannot name it)."""
    outputs = run([(29, {"policy": KvPolicy.PAGED})], seed=1, overlap=True)
    assert outputs == run([], seed=1, overlap=True)
