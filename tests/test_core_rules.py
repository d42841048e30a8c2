"""The core's rules that no figure shows: strict FCFS under every limit, which request a
preemption or a failed worker sends back and where, the context as a finish line, the reason a
stall is counted under, and a worker failing some requests or a whole step."""

from __future__ import annotations

import pytest

from scheduler_svc.config import BatchMode, CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.output import Refused
from scheduler_svc.sequence import Finish
from tests.sim import Overlapped, Recording, check_invariants, ids, ran, seq, step


def waiting(core: Scheduler) -> list[str]:
    return [s.request_id for s in core.waiting]


def finishes(core: Scheduler) -> dict[str, tuple[Finish, str]]:
    return {e.request_id: (e.finish, e.error) for e in core.take_events() if e.finish}


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- strict FCFS ---------------------------------------------------------------------------


def test_a_head_short_of_kv_is_not_overtaken_by_a_request_that_fits() -> None:
    """Paged KV: A holds 9 of 30 blocks and grows; C needs 23 now, D needs 1 and would fit."""
    core = Recording(CoreConfig(token_budget=64), [WorkerSpec("w", 30, 1, 4096)])
    core.add(seq("A", 8, max_tokens=20))
    step(core)
    core.add(seq("C", 23, max_tokens=2))
    core.add(seq("D", 1, max_tokens=2))
    for _ in range(5):
        assert ran(step(core)) == {"A": 1}
        assert waiting(core) == ["C", "D"]
        assert core.snapshot().head_wait_reason == "kv_capacity"
    assert core.stalls == {"kv_capacity": 5}


def test_a_head_over_the_token_budget_is_not_overtaken_without_chunked_prefill() -> None:
    """A's decode leaves 9 of the 10 tokens: C's prompt of 10 waits whole, D's 2 would fit."""
    config = CoreConfig(token_budget=10, chunked_prefill=False)
    core = Recording(config, [WorkerSpec("w", 100, 1, 4096)])
    core.add(seq("A", 3, max_tokens=4))
    step(core)
    core.add(seq("C", 10, max_tokens=2))
    core.add(seq("D", 2, max_tokens=2))
    for _ in range(3):
        assert ran(step(core)) == {"A": 1}
        assert waiting(core) == ["C", "D"]
        assert core.snapshot().head_wait_reason == "token_budget"
    assert ran(step(core)) == {"C": 10}  # A has finished: C goes first, whole; D after it
    assert waiting(core) == ["D"]


def test_a_chunked_head_takes_what_the_budget_leaves_and_the_rest_waits() -> None:
    core = Recording(CoreConfig(token_budget=10), [WorkerSpec("w", 100, 1, 4096)])
    core.add(seq("A", 3, max_tokens=9))
    step(core)
    core.add(seq("C", 30, max_tokens=2))
    core.add(seq("D", 2, max_tokens=2))
    assert ran(step(core)) == {"A": 1, "C": 9}
    assert waiting(core) == ["D"] and core.snapshot().head_wait_reason == "token_budget"
    assert ran(step(core)) == {"A": 1, "C": 9}


# ---- preemption and failed workers: who goes back, and where --------------------------------


def test_the_newest_running_request_is_preempted_and_waits_at_the_front() -> None:
    """Three run and the pool runs out as they grow: the one admitted last goes back, ahead of a
    request that was already waiting, and is admitted again before it; the oldest is never
    preempted, and every output is whole."""
    core = Recording(CoreConfig(token_budget=64, max_running=3), [WorkerSpec("w", 12, 2, 4096)])
    seqs = {rid: seq(rid, 4, 10) for rid in ("old", "mid", "new", "late")}
    for rid in ("old", "mid", "new"):
        core.add(seqs[rid])
    step(core)
    core.add(seqs["late"])
    while not core.preemptions:
        step(core)
        check_invariants(core)
    assert waiting(core) == ["new", "late"]
    assert [s.request_id for s in core.workers[0].running] == ["old", "mid"]
    admitted = []
    while core.waiting or core.workers[0].running:
        admitted += [s.request_id for planned in step(core) for s in planned.added]
        check_invariants(core)
    assert admitted.index("new") < admitted.index("late")
    assert seqs["old"].preemptions == 0 and seqs["new"].preemptions >= 1
    assert all(len(s.output_ids) == s.max_tokens for s in seqs.values())


def test_a_failed_worker_requeues_its_requests_oldest_first_ahead_of_the_queue() -> None:
    core = Recording(CoreConfig(max_running=3), [WorkerSpec("w0", 200, 4, 4096)])
    for rid in ("a", "b", "c", "d"):
        core.add(seq(rid, 4, 20))
    step(core)
    assert waiting(core) == ["d"]
    moved = core.fail_worker(0)
    assert [s.request_id for s in moved] == ["a", "b", "c"]
    assert waiting(core) == ["a", "b", "c", "d"]
    assert [s.preemptions for s in moved] == [1, 1, 1] and core.preemptions == 3
    kv = core.snapshot().workers[0]
    assert (kv.running, kv.free, kv.healthy) == (0, 800, False)
    assert core.snapshot().waiting_tokens == 3 * 5 + 4  # prompt + the token each produced


def test_a_preempted_request_keeps_its_arrival_and_is_admitted_once_in_the_events() -> None:
    clock = Clock(10.0)
    core = Recording(CoreConfig(max_running=2), [WorkerSpec("w0", 200, 4, 4096)], clock=clock)
    core.add(seq("a", 4, 20))
    clock.now = 12.5
    step(core)
    core.fail_worker(0)
    core.fail_worker(0)  # nothing left to move: no second preemption
    core.restore_worker(0)
    clock.now = 20.0
    step(core)
    admitted = [e for e in core.take_events() if e.admitted]
    assert [(e.request_id, e.queue_time) for e in admitted] == [("a", 2.5)]
    assert core.seqs["a"].arrival == 10.0 and core.seqs["a"].preemptions == 1
    core.fail_worker(0)
    assert core.seqs["a"].preemptions == 2 and core.preemptions == 2


# ---- the context as a finish line -----------------------------------------------------------


@pytest.mark.parametrize("policy", list(KvPolicy))
@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_submitted_past_the_context_stops_at_the_context(policy, overlap) -> None:
    """prompt 10 + max_tokens 20 on a context of 16 (the gateway refuses it, the core takes it):
    exactly 6 tokens, LENGTH, and never more KV than the context."""
    core = Recording(CoreConfig(policy=policy), [WorkerSpec("w", 64, 4, 16)])
    r = seq("r", 10, 20)
    core.add(r)
    driver = Overlapped(core)
    for _ in range(20):
        if overlap:
            driver.step()
        else:
            step(core)
        check_invariants(core)
        assert core.workers[0].kv.pool.allocated("r") <= 4  # 16 positions of 4
    driver.flush()
    assert r.finish is Finish.LENGTH and len(r.output_ids) == 6
    assert finishes(core) == {"r": (Finish.LENGTH, "")}
    assert core.generated == 6


def test_a_prompt_one_short_of_the_context_gets_one_token() -> None:
    core = Recording(CoreConfig(), [WorkerSpec("w", 64, 4, 16)])
    r = seq("r", 15, 5)
    core.add(r)
    step(core)
    assert r.finish is Finish.LENGTH and len(r.output_ids) == 1


@pytest.mark.parametrize("resumed", [5, 6, 10])
def test_a_resubmission_whose_resumed_tokens_fill_the_context_is_refused_for_good(resumed):
    """Prompt 10 + resumed tokens reaching the context of 16 leave nothing to generate: a
    refusal at the door (it had been taken, then failed "no worker can hold this request;
    retry", a condition no retry changes; internal-services sweep M5). One short of it (5),
    the request is taken and gets its one token."""
    core = Recording(CoreConfig(), [WorkerSpec("w", 64, 4, 16)])
    r = seq("r", 10, 20)
    r.output_ids = [5] * resumed
    if resumed == 5:
        core.add(r)
        step(core)
        assert r.finish is Finish.LENGTH and len(r.output_ids) == 6
        return
    with pytest.raises(Refused, match=f"{resumed} resumed tokens leave no room to generate"):
        core.add(r)


# ---- the reason a stall is counted under ----------------------------------------------------


def test_a_stall_counts_the_reason_of_the_worker_with_the_most_free_kv() -> None:
    """w0 has the most free KV but its running limit is reached; w1 lacks the KV: the head
    waits for w0's limit, and the stall is counted there, once per step."""
    core = Recording(
        CoreConfig(max_running=2), [WorkerSpec("w0", 100, 1, 4096), WorkerSpec("w1", 60, 1, 4096)]
    )
    for rid, prompt, max_tokens in (("a", 5, 50), ("b", 5, 50), ("c", 45, 10)):
        core.add(seq(rid, prompt, max_tokens))
    step(core)
    where = {s.request_id: ws.spec.name for ws in core.workers for s in ws.running}
    assert where == {"a": "w0", "b": "w0", "c": "w1"}
    core.add(seq("d", 30, 5))
    step(core)
    step(core)
    snap = core.snapshot()
    assert snap.head_wait_reason == "max_running" and snap.stalls == {"max_running": 2}
    assert [kv.stalls for kv in snap.workers] == [{"max_running": 2}, {}]


def test_a_stall_on_the_roomier_worker_counts_kv_there() -> None:
    """The other way round: w1 has the most free KV but not enough for the head, w0 its limit."""
    core = Recording(
        CoreConfig(max_running=1), [WorkerSpec("w0", 100, 1, 4096), WorkerSpec("w1", 60, 1, 4096)]
    )
    core.add(seq("a", 95, 5))  # w0: 5 free positions, its one running slot taken
    step(core)
    core.add(seq("b", 30, 5))  # w1: 60 free, it takes b
    step(core)
    core.add(seq("c", 40, 5))  # w1 has the most free (30) but not 40; w0 is at its limit
    step(core)
    snap = core.snapshot()
    assert snap.head_wait_reason == "max_running"
    assert [kv.stalls for kv in snap.workers] == [{}, {"max_running": 1}]


# ---- a worker fails some requests, or a whole step ------------------------------------------


def decoding(n: int = 3) -> tuple[Scheduler, list]:
    core = Recording(CoreConfig(), [WorkerSpec("w0", 100, 4, 4096)])
    seqs = [seq(rid, 4, 10) for rid in "abc"[:n]]
    for s in seqs:
        core.add(s)
    step(core)
    core.take_events()
    return core, seqs


def test_a_request_the_worker_cannot_run_fails_alone_and_the_rest_of_the_step_stands() -> None:
    core, (a, b, c) = decoding()
    planned = core.schedule(0)
    core.fail_items(planned, {b.handle: "token 99999 is outside the vocabulary"}, "w0")
    assert planned.decodes == [a, c] and planned.decode_handles == [a.handle, c.handle]
    core.complete(planned, [11, 13])
    assert (a.output_ids[-1], c.output_ids[-1]) == (11, 13) and len(b.output_ids) == 1
    assert finishes(core) == {
        "b": (
            Finish.ERROR,
            "worker w0 could not run this request: token 99999 is outside the vocabulary",
        )
    }
    step(core)
    assert "b" not in core.seqs and core.workers[0].kv.pool.allocated("b") == 0


def test_a_chunk_the_worker_cannot_run_fails_alone() -> None:
    core = Recording(CoreConfig(), [WorkerSpec("w0", 100, 4, 4096)])
    a, b = seq("a", 4, 10), seq("b", 6, 10)
    core.add(a)
    core.add(b)
    planned = core.schedule(0)
    core.fail_items(planned, {a.handle: "bad"}, "w0")
    assert [w.seq for w in planned.chunks] == [b]
    core.complete(planned, [21])
    assert b.output_ids == [21] and a.finish is Finish.ERROR and not a.output_ids


def test_a_request_finished_since_the_step_was_planned_is_not_failed_again() -> None:
    core, (a, b, c) = decoding()
    planned = core.schedule(0)
    handle = b.handle
    core.abort("b")
    core.fail_items(planned, {handle: "bad"}, "w0")
    assert finishes(core) == {"b": (Finish.CANCELLED, "")}
    assert core.finished == 1 and planned.decodes == [a, c]


def test_a_step_the_model_failed_fails_its_requests_but_not_one_that_moved_since() -> None:
    core, (a, b, c) = decoding()
    planned = core.schedule(0)
    core.abort("c")  # finished since: keeps its own finish
    failed = core.fail_step(planned, "the model failed on this request's batch")
    assert ids(failed) == ["a", "b"]
    assert finishes(core) == {
        "a": (Finish.ERROR, "the model failed on this request's batch"),
        "b": (Finish.ERROR, "the model failed on this request's batch"),
        "c": (Finish.CANCELLED, ""),
    }


def test_after_a_worker_leaves_only_the_requests_no_live_worker_holds_fail() -> None:
    core = Recording(
        CoreConfig(), [WorkerSpec("long", 200, 1, 4096), WorkerSpec("short", 200, 1, 64)]
    )
    for rid, prompt in (("p1", 100), ("s1", 10), ("p2", 80)):
        core.add(seq(rid, prompt, 5))
    core.drain_worker(0)
    assert ids(core.fail_unplaceable()) == ["p1", "p2"]
    assert waiting(core) == ["s1"]
    errors = finishes(core)
    assert set(errors) == {"p1", "p2"}
    assert all(f is Finish.ERROR and "failed or draining; 1 live" in e for f, e in errors.values())
    core.fail_worker(1)
    assert ids(core.fail_unplaceable()) == ["s1"]
    assert finishes(core)["s1"] == (
        Finish.ERROR,
        "no live worker can hold this request (the workers that could are failed or "
        "draining; 0 live); retry",
    )


# ---- which workers can hold a request -------------------------------------------------------


def test_a_request_that_needs_the_whole_pool_is_accepted_and_runs_to_the_end() -> None:
    core = Recording(CoreConfig(), [WorkerSpec("w", 10, 1, 4096)])
    r = seq("r", 5, 5)  # 10 positions of 10
    core.add(r)
    for _ in range(8):
        step(core)
    assert r.finish is Finish.LENGTH and len(r.output_ids) == 5 and core.preemptions == 0


def test_a_worker_too_small_for_a_request_does_not_hide_the_next_one() -> None:
    core = Recording(
        CoreConfig(), [WorkerSpec("small", 10, 1, 4096), WorkerSpec("big", 9, 8, 4096)]
    )
    core.add(seq("r", 30, 5))  # 35 positions: only "big" (72) holds it
    step(core)
    assert [s.request_id for s in core.workers[1].running] == ["r"]


def test_a_context_that_holds_the_request_exactly_is_not_a_short_one() -> None:
    """prompt 10 + max_tokens 10 = 20 = w0's context: w0 holds all of it and has the most free
    KV, so it takes the request (a worker that would cut it short is the last resort)."""
    core = Recording(CoreConfig(), [WorkerSpec("w0", 200, 1, 20), WorkerSpec("w1", 100, 1, 4096)])
    core.add(seq("r", 10, 10))
    step(core)
    assert [s.request_id for s in core.workers[0].running] == ["r"]


def test_a_request_requeued_with_a_workers_whole_context_is_not_placed_there() -> None:
    """r made 6 tokens on w0 (16 known); w0 fails: w1's context of 16 leaves it no room to
    generate, so no live worker can hold it and it fails rather than wait for ever on w1."""
    core = Recording(CoreConfig(), [WorkerSpec("w0", 200, 1, 4096), WorkerSpec("w1", 100, 1, 16)])
    r = seq("r", 10, 30)
    core.add(r)
    for _ in range(6):
        step(core)
    assert r.worker == 0 and len(r.output_ids) == 6
    core.fail_worker(0)
    step(core)
    assert r.finish is Finish.ERROR and "failed or draining" in r.error


def test_a_removed_worker_no_longer_counts_as_live() -> None:
    core = Recording(CoreConfig(), [WorkerSpec("long", 200, 1, 4096), WorkerSpec("s", 200, 1, 64)])
    core.remove_worker(0)
    with pytest.raises(Refused, match="context of 64 tokens"):
        core.add(seq("r", 100, 5))
    assert [s.request_id for s in core.waiting] == [] and core.refused == {"context": 1}


@pytest.mark.parametrize("planning", [0, 1])
def test_of_two_equal_workers_the_one_planning_now_takes_the_head(planning) -> None:
    core = Recording(CoreConfig(), [WorkerSpec("w0", 50, 1, 4096), WorkerSpec("w1", 50, 1, 4096)])
    core.add(seq("a", 5, 5))
    assert core.schedule(planning).ran() == {"a": 5}
    assert core.take_wakes() == set()


def test_a_restored_worker_takes_requests_again_with_its_new_pool() -> None:
    core = Recording(CoreConfig(), [WorkerSpec("w0", 50, 1, 4096)])
    core.fail_worker(0)
    with pytest.raises(Refused, match="no live worker"):
        core.add(seq("a", 5, 5))
    core.restore_worker(0, WorkerSpec("w0", 20, 4, 4096))
    core.add(seq("a", 5, 5))
    step(core)
    kv = core.snapshot().workers[0]
    assert (kv.capacity, kv.block_size, kv.running, kv.healthy) == (80, 4, 1, True)
    assert core.workers[0].kv.pool.allocated("a") == 2  # 6 positions in blocks of 4


# ---- refusals: the reason and the message a client gets --------------------------------------


@pytest.mark.parametrize(
    ("config", "prompt", "max_tokens", "reason", "message"),
    [
        (
            CoreConfig(),
            100,
            1,
            "context",
            "prompt of 100 tokens leaves no room to generate within the model's context of 64 "
            "tokens; shorten the prompt",
        ),
        (
            CoreConfig(),
            30,
            40,
            "kv_capacity",
            "request needs up to 64 KV positions (prompt 30 + max_tokens 40) but a worker holds "
            "48; lower max_tokens or raise the KV capacity",
        ),
        (
            CoreConfig(token_budget=8, chunked_prefill=False),
            9,
            1,
            "token_budget",
            "prompt of 9 tokens exceeds the token budget of 8 and chunked prefill is off; enable "
            "it or raise the budget",
        ),
    ],
)
def test_a_request_that_can_never_run_is_refused_with_what_to_change(
    config, prompt, max_tokens, reason, message
) -> None:
    core = Recording(config, [WorkerSpec("w", 12, 4, 64)])  # 48 positions, context 64
    for _ in range(2):
        with pytest.raises(Refused) as err:
            core.add(seq("x", prompt, max_tokens))
        assert (err.value.reason, str(err.value)) == (reason, message)
    assert core.refused == {reason: 2} and not core.waiting


def test_without_a_live_worker_every_request_is_refused() -> None:
    core = Recording(CoreConfig(), [WorkerSpec("w", 12, 4, 64)])
    core.drain_worker(0)
    with pytest.raises(Refused) as err:
        core.add(seq("x", 3, 3))
    assert (err.value.reason, str(err.value)) == (
        "no_worker",
        "no live worker: none has joined, or all are down or draining",
    )


def test_a_duplicate_request_id_is_refused_while_in_flight_and_welcome_after() -> None:
    core = Recording(CoreConfig(), [WorkerSpec("w", 100, 4, 4096)])
    first = seq("x", 3, 1)
    core.add(first)
    with pytest.raises(Refused) as err:
        core.add(seq("x", 3, 1))
    assert (err.value.reason, str(err.value)) == (
        "duplicate",
        "request id 'x' is already in flight",
    )
    assert core.refused == {"duplicate": 1}
    step(core)  # x finishes (1 token)
    step(core)  # its worker lets it go
    assert first.is_finished and "x" not in core.seqs
    core.add(seq("x", 3, 1))


def test_static_batching_prefills_a_prompt_past_the_token_budget_in_one_execution() -> None:
    config = CoreConfig(token_budget=8, chunked_prefill=False, mode=BatchMode.STATIC)
    core = Recording(config, [WorkerSpec("w", 100, 1, 4096)])
    core.add(seq("long", 20, 2))
    assert ran(step(core)) == {"long": 20}


# ---- KV: exactly what the planned tokens need ----------------------------------------------


def test_paged_kv_allocates_no_position_ahead_of_need() -> None:
    core = Recording(CoreConfig(token_budget=8), [WorkerSpec("w", 200, 1, 4096)])
    for rid, prompt in (("a", 5), ("b", 13), ("c", 2)):
        core.add(seq(rid, prompt, 9))
    for _ in range(12):
        step(core)
        kv = core.snapshot().workers[0]
        assert kv.reserved_unwritten == 0, kv
    assert all(s.is_finished for s in core.seqs.values()) or not core.seqs


def test_a_head_whose_first_chunk_fits_is_admitted_though_its_prompt_does_not_yet() -> None:
    """A holds 11 of 24 positions; B's prompt of 16 does not fit the 13 free, a first chunk of
    12 (the budget) does: B starts now, beside A's decode, with the 11 tokens left."""
    core = Recording(CoreConfig(token_budget=12), [WorkerSpec("w", 24, 1, 4096)])
    core.add(seq("A", 10, 4))
    step(core)
    core.add(seq("B", 16, 2))
    assert ran(step(core)) == {"A": 1, "B": 11}


def test_a_head_that_needs_exactly_the_free_kv_is_admitted() -> None:
    core = Recording(CoreConfig(token_budget=64), [WorkerSpec("w", 20, 1, 4096)])
    core.add(seq("A", 10, 5))
    step(core)  # A: 10 written, 11 after its next decode
    core.add(seq("B", 9, 1))  # 9 = 20 - 11
    assert ran(step(core)) == {"A": 1, "B": 9}


@pytest.mark.parametrize(("prompt", "reason"), [(17, "kv_reserved"), (18, "kv_capacity")])
def test_reserve_tells_kv_held_by_reservations_from_kv_that_is_not_there(prompt, reason) -> None:
    """B reserves 20 of 24 positions and has written 7: 4 are free, 13 reserved but unwritten.
    C's prompt of 17 would fit beside B's data (kv_reserved), one of 18 would not (kv_capacity)."""
    core = Recording(
        CoreConfig(policy=KvPolicy.RESERVE, token_budget=64), [WorkerSpec("w", 24, 1, 4096)]
    )
    core.add(seq("B", 6, max_tokens=14))
    step(core)
    core.add(seq("C", prompt, max_tokens=2))
    assert ran(step(core)) == {"B": 1}
    assert core.snapshot().head_wait_reason == reason


# ---- tokens in and out ----------------------------------------------------------------------


def test_each_request_stops_on_its_own_end_tokens_in_a_shared_decode_step() -> None:
    """a ends on 7, b on 9 (added last): a decode step's tokens are checked against every
    request's end tokens, not only the last one added."""
    core = Recording(CoreConfig(), [WorkerSpec("w", 100, 1, 4096)])
    a = seq("a", 3, 10, eos_ids=frozenset({7}))
    b = seq("b", 3, 10, eos_ids=frozenset({9}))
    core.add(a)
    core.add(b)
    planned = core.schedule_all()[0]
    core.complete(planned, [5, 5])  # the prefill samples one token each
    planned = core.schedule_all()[0]
    assert planned.decodes == [a, b]
    core.complete(planned, [7, 8])
    assert (a.finish, a.output_ids) == (Finish.STOP, [5, 7]) and not b.is_finished
    planned = core.schedule_all()[0]
    core.complete(planned, [9])
    assert (b.finish, b.output_ids) == (Finish.STOP, [5, 8, 9])


def test_an_end_token_sampled_by_the_prefill_ends_the_request_at_once() -> None:
    core = Recording(CoreConfig(), [WorkerSpec("w", 100, 1, 4096)])
    r = seq("r", 3, 10, eos_ids=frozenset({7}))
    ignoring = seq("i", 3, 10, eos_ids=frozenset({7}), ignore_eos=True)
    core.add(r)
    core.add(ignoring)
    core.complete(core.schedule_all()[0], [7, 7])
    assert (r.finish, r.output_ids) == (Finish.STOP, [7])
    assert not ignoring.is_finished and ignoring.output_ids == [7]
    assert finishes(core) == {"r": (Finish.STOP, "")}


def test_a_worker_answering_with_the_wrong_number_of_tokens_is_an_error() -> None:
    core, _ = decoding()
    planned = core.schedule(0)
    with pytest.raises(ValueError):
        core.complete(planned, [1, 2, 3, 4])


def test_a_request_finished_between_plan_and_complete_drops_its_token_alone() -> None:
    core, (a, b, c) = decoding()
    planned = core.schedule(0)
    core.abort("b")
    core.complete(planned, [11, 12, 13])
    assert (a.output_ids[-1], c.output_ids[-1], b.output_ids[-1]) == (11, 13, b.output_ids[0])
    tokens = [(e.request_id, e.token_id) for e in core.take_events() if e.token_id]
    assert tokens == [("a", 11), ("c", 13)]
    assert core.generated == 3 + 2


def test_decodes_and_a_chunk_share_the_budget_to_the_last_token() -> None:
    core = Recording(CoreConfig(token_budget=3), [WorkerSpec("w", 100, 1, 4096)])
    for rid, prompt in (("a", 1), ("b", 1), ("c", 10)):
        core.add(seq(rid, prompt, 9))
    assert ran(step(core)) == {"a": 1, "b": 1, "c": 1}
    for _ in range(3):  # c prefills with what the two decodes leave
        assert ran(step(core)) == {"a": 1, "b": 1, "c": 1}


@pytest.mark.parametrize("budget", [3, 64])
def test_with_overlap_a_request_decodes_exactly_once_per_token_it_still_needs(budget) -> None:
    """max_tokens is known in advance: a request whose last token is in flight gets no more
    decodes, while c's long prompt prefills beside them (budget 3) as when it is in at once."""
    core = Recording(CoreConfig(token_budget=budget), [WorkerSpec("w", 100, 1, 4096)])
    seqs = [seq(rid, p, n) for rid, p, n in (("a", 1, 3), ("b", 1, 5), ("c", 7, 4))]
    for s in seqs:
        core.add(s)
    driver = Overlapped(core)
    decodes = {s.request_id: 0 for s in seqs}
    rounds = 0
    while not all(s.is_finished for s in seqs):
        for s in driver.step().decodes:
            decodes[s.request_id] += 1
        check_invariants(core)
        rounds += 1
        assert rounds < 20
    assert decodes == {"a": 2, "b": 4, "c": 3}  # the prefill samples the first token
    assert all(s.finish is Finish.LENGTH and len(s.output_ids) == s.max_tokens for s in seqs)
    # a request whose last token is in flight holds back none behind it in the batch
    assert rounds == {3: 9, 64: 6}[budget]


def test_without_chunked_prefill_a_requeued_request_recomputes_past_the_budget() -> None:
    """Prompt 8, budget 10, no chunking: after 4 tokens its worker fails; its 12 known tokens
    exceed the budget but are recomputed in chunks (only prompts must fit whole)."""
    config = CoreConfig(token_budget=10, chunked_prefill=False)
    core = Recording(config, [WorkerSpec("w", 100, 1, 4096)])
    r = seq("r", 8, 10)
    core.add(r)
    for _ in range(4):
        step(core)
    assert len(r.output_ids) == 4
    core.fail_worker(0)
    core.restore_worker(0)
    for _ in range(12):
        step(core)
    assert r.finish is Finish.LENGTH and len(r.output_ids) == 10


# ---- what the snapshot reports --------------------------------------------------------------


def test_the_snapshot_counts_what_happened() -> None:
    clock = Clock(10.0)
    core = Recording(
        CoreConfig(token_budget=64, max_running=2),
        [WorkerSpec("w0", 12, 2, 4096), WorkerSpec("w1", 10, 2, 4096)],
        clock=clock,
    )
    for rid in ("a", "b", "c", "d", "e"):
        core.add(seq(rid, 3, 2))
        clock.now += 1  # a arrives at 10, ..., e at 14
    step(core)  # a, b on w0; c, d on w1; e waits
    clock.now = 20.0
    snap = core.snapshot()
    assert (snap.waiting, snap.waiting_tokens, snap.running) == (1, 3, 4)
    assert (snap.steps, snap.admitted, snap.finished, snap.preemptions) == (2, 4, 0, 0)
    assert snap.oldest_wait == 20 - 14 and snap.head_wait_reason == "max_running"
    assert snap.stalls == {"max_running": 1} and snap.refused == {}
    w0 = snap.workers[0]
    assert (w0.name, w0.capacity, w0.written, w0.reserved_unwritten, w0.free) == (
        "w0",
        24,
        6,
        2,
        16,
    )
    assert (w0.running, w0.healthy, w0.draining, w0.block_size, w0.max_context) == (
        2,
        True,
        False,
        2,
        4096,
    )
    assert (w0.steps, w0.stalls) == (1, {"max_running": 1})
    core.fail_worker(1)  # c and d go back to the front, ahead of e
    step(core)  # a and b make their last token; w0's limit still holds c back
    clock.now = 30.0
    snap = core.snapshot()
    assert [s.request_id for s in core.waiting] == ["c", "d", "e"]
    assert (snap.waiting, snap.waiting_tokens, snap.running) == (3, 4 + 4 + 3, 2)
    assert (snap.steps, snap.admitted, snap.finished, snap.preemptions) == (3, 4, 2, 2)
    assert snap.oldest_wait == 30 - 12  # c arrived at 12
    assert [(kv.healthy, kv.steps) for kv in snap.workers] == [(True, 2), (False, 1)]
    core.drain_worker(0)
    assert [kv.draining for kv in core.snapshot().workers] == [True, False]


def test_a_request_cancelled_while_waiting_leaves_the_queue_and_its_tokens() -> None:
    core = Recording(CoreConfig(max_running=1), [WorkerSpec("w", 64, 4, 4096)])
    for rid, prompt in (("a", 4), ("b", 6), ("c", 3)):
        core.add(seq(rid, prompt, 50))
    step(core)
    assert core.snapshot().waiting_tokens == 9
    assert core.abort("b") and not core.abort("b")
    assert (core.snapshot().waiting_tokens, waiting(core)) == (3, ["c"])
    assert "b" not in core.seqs and finishes(core) == {"b": (Finish.CANCELLED, "")}


def test_a_request_no_worker_can_ever_hold_any_more_fails_saying_so() -> None:
    core = Recording(
        CoreConfig(), [WorkerSpec("long", 200, 1, 4096), WorkerSpec("short", 200, 1, 64)]
    )
    core.add(seq("r", 100, 5))
    core.remove_worker(0)  # gone for good: not a worker that may come back
    assert ids(core.fail_unplaceable()) == ["r"]
    assert finishes(core) == {
        "r": (Finish.ERROR, "no worker can hold this request (1 live); retry")
    }


def test_a_step_failure_that_arrives_after_its_worker_failed_fails_nothing_that_moved() -> None:
    core, seqs = decoding()
    planned = core.schedule(0)
    core.fail_worker(0)  # its requests wait for another worker now
    assert core.fail_step(planned, "the model failed") == []
    assert not any(s.is_finished for s in seqs) and waiting(core) == ["a", "b", "c"]


def test_a_request_cancelled_mid_prefill_leaves_no_trace_on_its_worker() -> None:
    core = Recording(CoreConfig(token_budget=5), [WorkerSpec("w", 100, 1, 4096)])
    core.add(seq("long", 20, 5))
    assert ran(step(core)) == {"long": 5}
    core.abort("long")
    step(core)
    check_invariants(core)
    ws = core.workers[0]
    assert (ws.running, ws.prefilling, ws.kv.pool.num_free) == ([], set(), 100)
    assert core.snapshot().oldest_wait == 0.0  # nothing waits
