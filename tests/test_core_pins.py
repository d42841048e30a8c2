"""The core's rules that its other tests did not pin: a live change that keeps a setting keeps its
effect (reservations, static batching, the prefix cache, also in a worker's fresh pool), changes
are counted one by one, a step answered with too few tokens is refused, a failed step's cached
blocks leave the cache, a request whose last token is in flight does not hold up the others,
and an admission reports the tokens it found cached."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler_svc.config import BatchMode, CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.reasons import StallReason
from tests.sim import Overlapped, Recording, check_invariants, ran, sample, seq, step


def finish_all(core: Scheduler, limit: int = 200) -> None:
    for _ in range(limit):
        if not core.seqs:
            return
        step(core)
        check_invariants(core)
    raise AssertionError("did not finish")


def cached_start(core: Scheduler, rid: str, prompt: list[int]) -> int:
    """Add a request with this prompt; the position its first chunk starts from."""
    core.add(dataclasses.replace(seq(rid, 1, 2), prompt_ids=list(prompt), num_planned=len(prompt)))
    [planned] = core.schedule_all()
    [work] = [w for w in planned.chunks if w.seq.request_id == rid]
    core.complete(planned, sample(planned))
    return work.start


def test_a_change_that_keeps_reserve_leaves_the_reservations_whole() -> None:
    """The seed's Figure 4 under reserve: B holds its whole reservation; another setting
    changes, the policy stays: nothing is trimmed."""
    core = Scheduler(
        CoreConfig(token_budget=8, policy=KvPolicy.RESERVE), [WorkerSpec("w0", 24, 1, 4096)]
    )
    core.add(seq("B", 6, max_tokens=14))
    step(core)
    before = core.snapshot().workers[0].reserved_unwritten
    core.reconfigure(dataclasses.replace(core.config, token_budget=9))
    assert core.snapshot().workers[0].reserved_unwritten == before > 0
    [planned] = core.schedule_all()
    assert planned.trims == []
    check_invariants(core)


def test_each_live_change_of_a_setting_is_counted() -> None:
    core = Scheduler(CoreConfig(token_budget=8), [WorkerSpec("w0", 24, 1, 4096)])
    core.reconfigure(dataclasses.replace(core.config, token_budget=9))
    core.reconfigure(dataclasses.replace(core.config, token_budget=10))
    assert core.setting_changes == {"token_budget": 2}


def test_static_batching_stays_static_when_another_setting_changes() -> None:
    core = Scheduler(
        CoreConfig(token_budget=64, mode=BatchMode.STATIC), [WorkerSpec("w0", 64, 4, 4096)]
    )
    core.add(seq("A", 4, max_tokens=8))
    step(core)
    core.reconfigure(dataclasses.replace(core.config, max_running=8))
    core.add(seq("B", 4, max_tokens=2))
    assert "B" not in ran(step(core))  # the batch has started: B waits for it to end
    assert core.snapshot().head_wait_reason == StallReason.STATIC_BATCH.value


PROMPT = list(range(10, 30))  # 20 tokens: five blocks of 4


def test_the_prefix_cache_stays_on_when_another_setting_changes() -> None:
    core = Scheduler(
        CoreConfig(token_budget=64, prefix_caching=True), [WorkerSpec("w0", 64, 4, 4096)]
    )
    assert cached_start(core, "A", PROMPT) == 0
    finish_all(core)
    core.reconfigure(dataclasses.replace(core.config, token_budget=32))
    assert cached_start(core, "B", PROMPT) == 16


def test_caching_turned_on_live_holds_in_a_restored_workers_fresh_pool() -> None:
    core = Scheduler(
        CoreConfig(token_budget=64, prefix_caching=False), [WorkerSpec("w0", 64, 4, 4096)]
    )
    core.reconfigure(dataclasses.replace(core.config, prefix_caching=True))
    core.fail_worker(0)
    core.restore_worker(0)
    assert cached_start(core, "A", PROMPT) == 0
    finish_all(core)
    assert cached_start(core, "B", PROMPT) == 16


def test_a_restored_worker_without_caching_caches_nothing() -> None:
    core = Scheduler(
        CoreConfig(token_budget=64, prefix_caching=False), [WorkerSpec("w0", 64, 4, 4096)]
    )
    core.fail_worker(0)
    core.restore_worker(0)
    assert cached_start(core, "A", PROMPT) == 0
    finish_all(core)
    assert cached_start(core, "B", PROMPT) == 0
    assert core.snapshot().workers[0].cached_blocks == 0


def test_a_step_answered_with_too_few_tokens_is_refused() -> None:
    core = Scheduler(CoreConfig(token_budget=64), [WorkerSpec("w0", 64, 4, 4096)])
    core.add(seq("A", 4, max_tokens=8))
    core.add(seq("B", 4, max_tokens=8))
    step(core)
    [planned] = core.schedule_all()
    assert len(planned.decodes) == 2
    with pytest.raises(ValueError):
        core.complete(planned, sample(planned)[:1])


def test_a_failed_steps_chunk_leaves_nothing_cached_for_the_next_request() -> None:
    core = Scheduler(
        CoreConfig(token_budget=64, prefix_caching=True), [WorkerSpec("w0", 64, 4, 4096)]
    )
    core.add(dataclasses.replace(seq("A", 1, 2), prompt_ids=list(PROMPT), num_planned=len(PROMPT)))
    [planned] = core.schedule_all()  # A's prompt, its four full blocks cached as planned
    core.fail_step(planned, "boom")
    check_invariants(core)
    assert core.snapshot().workers[0].cached_blocks == 0
    assert cached_start(core, "B", PROMPT) == 0


def test_a_request_whose_last_token_is_in_flight_does_not_hold_up_the_others() -> None:
    """With overlap: A's last token is in flight while C prefills in chunks; B, after A in
    admission order, still decodes in that step."""
    core = Scheduler(
        CoreConfig(token_budget=6, chunked_prefill=True), [WorkerSpec("w0", 64, 4, 4096)]
    )
    driver = Overlapped(core)
    core.add(seq("A", 2, max_tokens=2))
    core.add(seq("B", 2, max_tokens=8))
    driver.step()  # A and B's prompts
    core.add(seq("C", 20, max_tokens=2))
    planned = driver.step()  # A and B decode, C's first chunk
    assert [s.request_id for s in planned.decodes] == ["A", "B"]
    planned = driver.step()  # A's last token is in flight: B decodes beside C's chunk
    assert [s.request_id for s in planned.decodes] == ["B"] and planned.chunks
    driver.flush()
    check_invariants(core)


def test_an_admission_reports_the_prompt_tokens_it_found_cached() -> None:
    core = Recording(CoreConfig(prefix_caching=True), [WorkerSpec("w", 64, 4, 4096)])
    cached_start(core, "A", PROMPT)
    finish_all(core)
    core.take_events()
    cached_start(core, "B", PROMPT[:16] + [7, 8, 9])
    [admission] = [e for e in core.take_events() if e.admitted]
    assert (admission.request_id, admission.cached_tokens) == ("B", 16)
