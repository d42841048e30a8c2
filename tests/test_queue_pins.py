"""What the orderings' other tests left unpinned (survivors of the `queues` mutation group): the
core's counts by tenant and class, the service it charges (runs of several executions, steps
without decodes, the decode split counted again when the decodes change), fair's order with
charges and weights and its share arithmetic, the victims' room at its boundary, displacement
only on the live workers planned now and its memo of a head that found nobody, the explain view's
wait and cut, each ordering's standing and messages, and a live switch keeping the core's clock."""

from __future__ import annotations

import pytest

from llmcommon.tenancy import Tenancy
from scheduler_svc.config import CoreConfig, QueuePolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.live_settings import apply
from scheduler_svc.order_view import AHEAD_SHOWN, order_view
from scheduler_svc.reasons import StallReason
from scheduler_svc.request_queue import (
    DeadlineRequestQueue,
    FairRequestQueue,
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
)
from scheduler_svc.sequence import SeqStatus, Sequence
from scheduler_svc.step import Draft, Step, Work
from tests.sim import sample, seq, step
from tests.test_queue_orderings import Clock

SPEC = WorkerSpec("w0", num_blocks=64, block_size=4, max_context=128)


def core_of(policy: str, specs=(SPEC,), **config) -> Scheduler:
    return Scheduler(CoreConfig(queue_policy=QueuePolicy(policy), **config), list(specs))


def waiting(rid: str, arrival: float, prompt: int = 4, **tenancy) -> Sequence:
    s = Sequence(rid, [1] * prompt, 8, arrival=arrival, tenancy=Tenancy(**tenancy))
    s.status = SeqStatus.WAITING
    return s


def running(rid: str, arrival: float, **tenancy) -> Sequence:
    s = waiting(rid, arrival, **tenancy)
    s.status, s.max_planned = SeqStatus.RUNNING, 100
    return s


def ids(queue) -> list[str]:
    return [s.request_id for s in queue]


def of(tenant: str, slo_class: str = "") -> Tenancy:
    return Tenancy(tenant=tenant, slo_class=slo_class)


# the core's counts by tenant and class


def test_tenant_counts_count_the_waiting_and_the_running_by_tenant_and_class():
    core = core_of("fair", max_running=4)
    core.add(seq("a0", 6, 8, tenancy=of("a", "chat")))
    core.add(seq("b0", 4, 8, tenancy=of("b")))
    core.add(seq("a1", 5, 8, tenancy=of("a", "chat")))
    core.add(seq("b1", 3, 8, tenancy=of("b")))
    for i in range(3):
        core.add(seq(f"a{i + 2}", 4, 8, tenancy=of("a", "batch")))
    core.add(seq("b2", 4, 8, tenancy=of("b", "chat")))
    # b, which started waiting last, ties at 0 and goes first: b0, b1, b2, then a0 run, their
    # prompts charged after the step's admissions (4 + 3 + 4 and 6)
    step(core)
    counts = core.tenant_counts()
    assert counts.policy == "fair"
    assert counts.queued == {"a": 4} and counts.running == {"a": 1, "b": 3}
    assert counts.class_queued == {"batch": 3, "chat": 1}
    assert counts.class_running == {"chat": 2, "": 2}
    assert counts.service == {"a": 6.0, "b": 11.0}
    core.abort("b2")  # finished: counted neither waiting nor running
    counts = core.tenant_counts()
    assert counts.running == {"a": 1, "b": 2} and counts.class_running == {"chat": 1, "": 2}
    assert counts.queued == {"a": 4}


def test_tenant_counts_under_an_ordering_that_counts_no_service_have_none():
    core = core_of("fcfs", max_running=1)
    core.add(seq("a0", 4, 8, tenancy=of("a")))
    core.add(seq("a1", 4, 8, tenancy=of("a")))
    step(core)
    counts = core.tenant_counts()
    assert counts.policy == "fcfs" and counts.service == {}
    assert counts.queued == {"a": 1} and counts.running == {"a": 1}


# the service the core charges


def test_a_run_of_several_executions_charges_each_of_them_on_every_worker():
    core = core_of("fair", (SPEC, SPEC), decode_steps=3, decode_runs="fixed")
    core.add(seq("a0", 4, 60, tenancy=of("a")))
    core.add(seq("a1", 4, 60, tenancy=of("a")))
    step(core)
    assert {s.worker for s in core.seqs.values()} == {0, 1}
    before = core.waiting.counters["a"]
    steps = step(core)
    [runs] = {s.repeat for s in steps}
    assert runs > 1 and len(steps) == 2
    # two requests, `runs` executions each, a sampled token weighs 2
    assert core.waiting.counters["a"] - before == 2 * 2 * runs


def test_a_worker_with_nothing_to_decode_does_not_stop_the_charge_of_those_after_it():
    small = WorkerSpec("w0", num_blocks=32, block_size=4, max_context=128)
    core = core_of("fair", (small, SPEC))
    core.add(seq("a0", 4, 60, tenancy=of("a")))
    step(core)
    assert core.seqs["a0"].worker == 1  # the most free KV: worker 0 has nothing to run
    before = core.waiting.counters["a"]
    step(core)
    assert core.waiting.counters["a"] - before == 2


def test_prompt_chunks_of_one_tenant_on_several_workers_add_up():
    core = core_of("fair", (SPEC, SPEC))
    core.add(seq("a0", 6, 4, tenancy=of("a")))
    core.add(seq("a1", 5, 4, tenancy=of("a")))
    step(core)
    assert core.waiting.counters["a"] == 11


def charged(core: Scheduler, decodes: list[Sequence], chunks: list[Work] = ()) -> dict:
    """The service one step with these decodes (and chunks) on worker 0 charges, by tenant."""
    counters = core.waiting.counters
    before = dict(counters)
    planned = Step(0, 0, chunks=list(chunks), decodes=list(decodes))
    core._charge([planned])
    return {t: v - before.get(t, 0.0) for t, v in counters.items() if v != before.get(t, 0.0)}


def test_the_decode_split_follows_the_decodes_whatever_changed():
    """Each step's decodes are split by tenant as they are: another first or last request,
    another count, and (under overlap, with nothing admitted, finished or preempted) another
    request in the middle."""
    core = core_of("fair")
    a, b, c, x = (seq(f"{t}0", 4, 4, tenancy=of(t)) for t in "abcx")
    assert charged(core, [a, x]) == {"a": 2, "x": 2}
    assert charged(core, [a, x]) == {"a": 2, "x": 2}
    assert charged(core, [b, x]) == {"b": 2, "x": 2}  # another first
    assert charged(core, [b, c]) == {"b": 2, "c": 2}  # another last
    assert charged(core, [b, a, c]) == {"a": 2, "b": 2, "c": 2}  # another count
    assert charged(core, [b, x, c]) == {"b": 2, "c": 2, "x": 2}  # another in the middle


def test_a_draft_is_charged_its_fed_token_and_its_draft_tokens_as_sampled_service():
    core = core_of("fair")
    a, b = seq("a0", 4, 4, tenancy=of("a")), seq("b0", 4, 4, tenancy=of("b"))
    before = dict(core.waiting.counters)
    planned = Step(0, 0, decodes=[b], drafts=[Draft(a, 0, 4, [5, 6, 7])])
    core._charge([planned])
    got = {t: v - before.get(t, 0.0) for t, v in core.waiting.counters.items()}
    assert got == {"a": 2 * 4, "b": 2}  # 1 + 3 positions at the sampled weight of 2


def test_a_step_charges_its_chunks_and_decodes_together():
    core = core_of("fair")
    a, b = seq("a0", 4, 4, tenancy=of("a")), seq("b0", 4, 4, tenancy=of("b"))
    chunks = [Work(a, 0, 0, 3, False), Work(a, 0, 3, 2, True), Work(b, 1, 0, 7, True)]
    assert charged(core, [b], chunks) == {"a": 5, "b": 9}


# fair share: order, lifts, weights, shares


def test_fair_iterates_in_the_order_the_heads_would_take_charging_each_prompt_by_weight():
    q = FairRequestQueue()
    for i in range(3):
        q.add(waiting(f"a{i}", i, prompt=4, tenant="a"))
    q.charge("a", 10, 0)
    for i in range(3):
        q.add(waiting(f"b{i}", 10 + i, prompt=8, tenant="b", weight=2.0))
    # b lifted to a's 10, ties go to the newcomer; each b prompt adds 8 / 2, each a prompt 4
    assert q.counters == {"a": 10, "b": 10}
    assert ids(q) == ["b0", "a0", "b1", "a1", "b2", "a2"]
    assert q.counters == {"a": 10, "b": 10}  # iterating charges nothing


def test_fair_keeps_the_higher_counter_of_a_tenant_that_starts_waiting_again():
    q = FairRequestQueue()
    q.add(a0 := waiting("a0", 0, tenant="a"))
    q.add(waiting("b0", 1, tenant="b"))
    q.charge("a", 100, 0)
    q.charge("b", 10, 0)
    q.remove(a0)
    q.add(waiting("a1", 2, tenant="a"))  # the floor is b's 10: a keeps its 100
    assert q.counters["a"] == 100 and ids(q) == ["b0", "a1"]


def test_fair_counts_each_waiting_request_of_a_tenant():
    q = FairRequestQueue()
    q.add(waiting("a0", 0, tenant="a"))
    q.add(waiting("a1", 1, tenant="a"))
    q.charge("a", 50, 0)
    assert q.pop().request_id == "a0"  # a1 still waits: a is still waiting
    q.charge("a", 50, 0)
    q.add(waiting("b0", 2, tenant="b"))
    assert q.counters["b"] == 100  # lifted to the counter of a, which waits


def test_fair_takes_a_weight_of_zero_as_one():
    q = FairRequestQueue()
    q.add(head := waiting("a0", 0, tenant="a", weight=0.0))
    q.charge("a", 10, 1)
    assert q.counters["a"] == 12 and q.standing(head)["weight"] == "1"


def test_fair_charges_a_tenant_it_never_saw_from_zero_with_weight_one():
    q = FairRequestQueue()  # a tenant running since before a live switch to fair
    q.charge("x", 10, 1)
    assert q.counters == {"x": 12}


def test_fair_standing_names_the_counter_and_the_weight():
    q = FairRequestQueue()
    q.add(head := waiting("a0", 0, tenant="a", weight=2.5, slo_class="chat"))
    q.charge("a", 7, 0)
    assert q.standing(head) == {
        "tenant": "a",
        "priority": "0",
        "slo_class": "chat",
        "counter": "3",
        "weight": "2.5",
    }


def test_fair_share_at_its_boundary_with_three_tenants():
    """Six places, three tenants of weight 1: a share of 2 each. The head's tenant, holding
    one, may take a second from the one above its share; holding two, it may not."""
    q = FairRequestQueue()
    q.add(head := waiting("a9", 50, tenant="a"))
    q.charge("b", 10, 0)  # served more than a (a tie would go to b, back in the queue)
    b = [running(f"b{i}", i, tenant="b") for i in range(3)]
    run = [running("a0", 10, tenant="a"), *b, running("c0", 20, tenant="c")]
    run.append(running("c1", 21, tenant="c"))
    assert q.victim(head, run, 6) is b[2]
    run = [running("a0", 10, tenant="a"), running("a1", 11, tenant="a"), *b]
    run.append(running("c0", 20, tenant="c"))
    assert q.victim(head, run, 6) is None


def test_fair_share_by_unequal_weights_and_places():
    """Tenants the queue never saw weigh 1. Head a (weight 3) against b and c (1 each): a's
    share of 5 places is 3, b's and c's 1 each."""
    q = FairRequestQueue()
    q.add(head := waiting("a9", 50, tenant="a", weight=3.0))
    q.charge("b", 10, 0)  # served more than a
    b = [running(f"b{i}", i, tenant="b") for i in range(2)]
    c = [running("c0", 5, tenant="c")]
    run = [running("a0", 10, tenant="a"), running("a1", 11, tenant="a"), *b, *c]
    assert q.victim(head, run, 5) is b[1]  # a holds 2 of 3; b holds 2 of 1
    assert q.victim(head, [*run, running("a2", 12, tenant="a")], 6) is None  # a holds 3 of 3
    # b over its share, but the head's tenant holds its own: nobody for it
    assert q.victim(head, [running(f"a{i}", 10 + i, tenant="a") for i in range(3)] + b, 5) is None


def test_fair_names_the_most_served_of_the_tenants_above_their_share():
    q = FairRequestQueue()
    q.add(head := waiting("a9", 50, tenant="a"))
    q.charge("b", 10, 0)
    q.charge("c", 500, 0)
    b = [running(f"b{i}", i, tenant="b") for i in range(2)]
    c = [running(f"c{i}", 10 + i, tenant="c") for i in range(2)]
    assert q.victim(head, b + c, 4) is c[1]  # a share of 4/3: both over, c served more
    q.charge("b", 1000, 0)
    assert q.victim(head, b + c, 4) is b[1]
    q.counters.pop("b"), q.counters.pop("c")  # neither counted: back, either wins the tie
    assert q.victim(head, b + c, 4) is None


def test_fair_names_the_newest_evictable_request_of_the_tenant_above_its_share():
    q = FairRequestQueue()
    q.add(head := waiting("a9", 50, tenant="a"))
    b = [running(f"b{i}", i, tenant="b") for i in range(3)]
    b[2].max_planned = b[2].num_planned  # its last token in flight: not worth it
    other = running("a0", 20, tenant="a")
    other.max_planned = other.num_planned
    q.charge("b", 10, 0)  # b served more than a
    assert q.victim(head, [other, *b], 4) is b[1]


def test_fair_preempts_a_lower_priority_request_first_and_only_an_evictable_one():
    q = FairRequestQueue()
    q.add(head := waiting("a9", 50, tenant="a", priority=1))
    same = [running(f"b{i}", i, tenant="b", priority=1) for i in range(3)]
    low = running("c0", 5, tenant="c", priority=4)
    lower = running("c1", 6, tenant="c", priority=2)
    assert q.victim(head, [*same, lower, low], 5) is low  # the lowest priority first
    low.max_planned = low.num_planned
    assert q.victim(head, [*same, lower, low], 5) is lower
    lower.max_planned = lower.num_planned  # none lower worth it: the share decides
    assert q.victim(head, [*same, lower, low], 5) is None  # b, served as little, wins the tie
    q.charge("b", 10, 0)  # b served more than a: back in the queue, its request comes after
    assert q.victim(head, [*same, lower, low], 5) is same[2]
    # a request at the head's own priority is never taken as a lower one
    peer = running("d0", 1, tenant="d", priority=1)
    assert q.victim(head, [peer], 2) is None
    # a better priority running is no victim: with only those, nobody
    top = running("e0", 1, tenant="e", priority=0)
    assert q.victim(head, [top, top], 2) is None


# priority and deadline


def test_priority_and_fair_and_deadline_name_the_request_that_does_not_wait():
    for q in (PriorityRequestQueue(), FairRequestQueue(), DeadlineRequestQueue()):
        with pytest.raises(ValueError, match="^ghost is not waiting$"):
            q.remove(waiting("ghost", 0))


def test_an_empty_fair_or_deadline_queue_says_so():
    for q in (FairRequestQueue(), DeadlineRequestQueue()):
        with pytest.raises(IndexError, match="^the queue is empty$"):
            q.peek()


def test_deadline_removes_a_late_entry_for_good():
    clock = Clock()
    q = DeadlineRequestQueue(clock)
    q.add(late := waiting("late", 0, ttft_s=1))
    q.add(waiting("hopeful", 0, ttft_s=50))
    clock.now = 2
    assert ids(q) == ["hopeful", "late"]
    q.remove(late)
    assert ids(q) == ["hopeful"] and q.pop().request_id == "hopeful"
    with pytest.raises(IndexError):
        q.peek()


def test_deadline_standing_names_the_seconds_left_and_a_class():
    clock = Clock(3.0)
    q = DeadlineRequestQueue(clock)
    q.add(a := waiting("a", 1, ttft_s=1, slo_class="chat", priority=2))
    q.add(b := waiting("b", 1))
    assert q.standing(a) == {
        "tenant": "default",
        "priority": "2",
        "slo_class": "chat",
        "deadline_s": "-1.000",
    }
    assert q.standing(b) == {"tenant": "default", "priority": "0"}


def test_every_ordering_built_by_name_keeps_the_clock_it_is_given():
    clock = Clock(5.0)
    q = create_request_queue("deadline", clock)
    q.add(waiting("chat", 4, ttft_s=2))
    q.add(waiting("batch", 0, ttft_s=60))
    assert ids(q) == ["chat", "batch"]  # at 5, chat's deadline (6) still holds
    clock.now = 7
    assert ids(q) == ["batch", "chat"]
    for policy in QueuePolicy:
        assert create_request_queue(policy, clock).clock is clock
    assert FCFSRequestQueue(clock).clock is clock


def test_a_live_switch_to_deadline_orders_by_the_cores_clock():
    clock = Clock(0.0)
    core = Scheduler(CoreConfig(max_running=1), [SPEC], clock=clock)
    core.add(seq("run", 4, 40))
    step(core)
    core.add(seq("chat", 4, 4, tenancy=Tenancy(ttft_s=1)))
    core.add(seq("batch", 4, 4, tenancy=Tenancy(ttft_s=60)))
    core.reconfigure(apply(core.config, {"queue_policy": "deadline"}))
    assert ids(core.waiting) == ["chat", "batch"]
    clock.now = 2.0  # chat's deadline passed on the core's clock: behind batch
    assert ids(core.waiting) == ["batch", "chat"]


def test_a_live_switch_to_fair_knows_the_weights_of_tenants_that_only_run():
    """C (weight 3) runs 3 of 4 places and A (weight 1) runs 1 when fair is switched on live:
    A's next request is within its share of nobody's (4 x 1/4 = 1 held), so it preempts no
    one, as under fair from the start; and C's service is charged at its weight 3."""
    ran = {}
    for live in (False, True):
        core = core_of("fcfs" if live else "fair", max_running=4)
        for i in range(3):
            core.add(seq(f"C{i}", 8, 100, tenancy=Tenancy(tenant="C", weight=3.0)))
        core.add(seq("A0", 8, 100, tenancy=Tenancy(tenant="A", weight=1.0)))
        for _ in range(3):
            step(core)
        if live:
            core.reconfigure(apply(core.config, {"queue_policy": "fair"}))
            assert core.waiting.weights == {"A": 1.0, "C": 3.0}
        core.add(seq("A1", 8, 4, tenancy=Tenancy(tenant="A", weight=1.0)))
        before = dict(core.waiting.counters)
        for _ in range(10):
            step(core)
        assert core.preemptions == 0
        assert "A1" in ids(core.waiting)
        ran[live] = {t: core.waiting.counters[t] - before.get(t, 0.0) for t in ("A", "C")}
    # ten steps of decodes: C's 3 rows cost it 3 x 2 x 10 / 3 = 20, A's one row 20
    assert ran[True]["C"] == pytest.approx(20.0) == pytest.approx(ran[False]["C"])
    assert ran[True]["A"] == pytest.approx(20.0)


# the stall counted for the ordering


def test_the_ordering_is_counted_once_per_step_and_only_while_it_holds_the_oldest_back():
    core = core_of("priority", max_running=1)
    core.add(seq("run", 4, 20, tenancy=Tenancy(priority=0)))
    step(core)
    core.add(seq("old", 4, 4, tenancy=Tenancy(priority=5)))
    step(core)  # the oldest is the head: nothing counted for the ordering
    assert core.stalls[StallReason.PRIORITY] == 0
    core.add(seq("new", 4, 4, tenancy=Tenancy(priority=1)))
    for _ in range(3):
        step(core)
    assert core.stalls[StallReason.PRIORITY] == 3


# the victims' room, displacement and its memo


def test_the_victims_stop_as_soon_as_they_leave_exactly_the_room_the_head_needs():
    spec = WorkerSpec("w0", num_blocks=6, block_size=4, max_context=128)  # 24 positions
    core = core_of("priority", (spec,))
    core.add(seq("low1", 3, 20, tenancy=Tenancy(priority=9)))
    core.add(seq("low2", 3, 20, tenancy=Tenancy(priority=9)))
    step(core)  # each holds one block, room in it for its next token: 16 positions free
    core.add(seq("top", 20, 2, tenancy=Tenancy(priority=0)))  # 5 blocks: low2's makes 20
    core.schedule_all()
    assert core.seqs["low2"].preemptions == 1 and core.seqs["low1"].preemptions == 0
    assert core.seqs["top"].admitted_at is not None


def test_a_victim_whose_next_token_needs_a_block_counts_that_block_as_taken():
    """low1's block is full: its next token takes a new one in this step, so low2's going
    alone leaves the head too little, and both go (before, low2 went and the head waited)."""
    spec = WorkerSpec("w0", num_blocks=6, block_size=4, max_context=128)
    core = core_of("priority", (spec,))
    core.add(seq("low1", 4, 20, tenancy=Tenancy(priority=9)))
    core.add(seq("low2", 4, 20, tenancy=Tenancy(priority=9)))
    step(core)
    core.add(seq("top", 20, 2, tenancy=Tenancy(priority=0)))
    core.schedule_all()
    assert core.seqs["low2"].preemptions == 1 and core.seqs["low1"].preemptions == 1
    assert core.seqs["top"].admitted_at is not None


def four_low_and_a_peer() -> Scheduler:
    """Two workers of one running place each: low (priority 9) on worker 1, peer (0) on 0;
    then top (0) waits for a place."""
    core = core_of("priority", (SPEC, SPEC), max_running=1)
    core.add(seq("low", 4, 50, tenancy=Tenancy(priority=9)))
    core.add(seq("peer", 4, 50, tenancy=Tenancy(priority=0)))
    step(core)
    assert core.seqs["low"].worker == 1 and core.seqs["peer"].worker == 0
    core.add(seq("top", 4, 4, tenancy=Tenancy(priority=0)))
    return core


def run_one(core: Scheduler, index: int) -> None:
    planned = core.schedule(index)
    core.complete(planned, sample(planned))


def test_a_head_preempts_only_on_the_workers_planned_now():
    core = four_low_and_a_peer()
    run_one(core, 0)  # worker 0's loop: peer is no victim, worker 1's low is not its to take
    assert core.seqs["low"].preemptions == 0 and core.seqs["top"].admitted_at is None
    run_one(core, 1)  # worker 1's loop: the head found nobody on 0, but 1 it did not ask
    assert core.seqs["low"].preemptions == 1 and core.seqs["top"].admitted_at is not None


def test_a_head_never_preempts_on_a_draining_worker():
    core = four_low_and_a_peer()
    core.drain_worker(1)
    for _ in range(3):
        step(core)
    assert core.seqs["low"].preemptions == 0 and core.seqs["top"].admitted_at is None


def test_a_head_preempts_on_a_live_worker_of_shorter_context_beside_a_draining_one():
    """Only worker 0 can hold the head's whole request; it drains. Worker 1, whose context ends
    the head early, is where it goes, and where it preempts."""
    short = WorkerSpec("w1", num_blocks=64, block_size=4, max_context=32)
    core = core_of("priority", (SPEC, short), max_running=1)
    core.add(seq("peer", 4, 50, tenancy=Tenancy(priority=0)))
    core.add(seq("low", 4, 20, tenancy=Tenancy(priority=9)))
    step(core)
    assert core.seqs["peer"].worker == 0 and core.seqs["low"].worker == 1
    core.drain_worker(0)
    core.add(seq("top", 4, 60, tenancy=Tenancy(priority=0)))
    step(core)
    assert core.seqs["low"].preemptions == 1 and core.seqs["top"].worker == 1


def test_a_head_that_found_nobody_is_not_asked_again_until_the_running_requests_change():
    core = four_low_and_a_peer()
    asked = []
    victim = core.waiting.victim
    core.waiting.victim = lambda head, rest, slots: asked.append(head) or victim(head, rest, slots)
    run_one(core, 0)
    run_one(core, 0)
    run_one(core, 0)
    assert len(asked) == 1  # once: nobody on worker 0, and nothing changed
    core.add(seq("other", 4, 4, tenancy=Tenancy(priority=5)))
    core.abort("other")  # a finish: the running requests may have changed
    run_one(core, 0)
    assert len(asked) == 2


# the explain view


def test_the_view_shows_the_wait_of_each_and_the_first_few_ahead_of_the_oldest():
    q = PriorityRequestQueue()
    q.add(waiting("old", 1.0, priority=5))
    for i in range(AHEAD_SHOWN + 2):
        q.add(waiting(f"new{i}", 2.0 + i, priority=1))
    view = order_view(q, now=3.5)
    assert view.policy == "priority"
    assert view.head.request_id == "new0" and view.head.wait_s == 1.5
    assert view.oldest.request_id == "old" and view.oldest.wait_s == 2.5
    assert [s.request_id for s in view.ahead] == [f"new{i}" for i in range(AHEAD_SHOWN)]
    assert view.ahead[2].wait_s == 0.0  # arrived after `now` (another clock): no negative wait


def test_the_view_lists_everyone_ahead_of_an_oldest_within_the_first_few():
    q = PriorityRequestQueue()
    q.add(waiting("old", 1.0, priority=5))
    for i in range(AHEAD_SHOWN):
        q.add(waiting(f"new{i}", 2.0 + i, priority=1))
    view = order_view(q, now=10.0)
    assert [s.request_id for s in view.ahead] == [f"new{i}" for i in range(AHEAD_SHOWN)]


def test_the_view_of_a_queue_whose_head_is_the_oldest_names_its_policy_and_wait():
    q = FCFSRequestQueue()
    q.add(waiting("a", 1.0))
    view = order_view(q, now=1.25)
    assert view.policy == "fcfs" and view.head.wait_s == 0.25
    assert view.oldest is None and view.ahead == []
    assert order_view(FCFSRequestQueue(), now=0.0) is None


# the budget a running prompt leaves to a head that outranks it


def ran_by_request(steps) -> dict[str, int]:
    return {w.seq.request_id: w.num_tokens for s in steps for w in s.chunks}


def long_prompt_running(policy: str = "priority", specs=(SPEC,), **config) -> Scheduler:
    core = core_of(policy, specs, token_budget=16, **config)
    core.add(seq("long", 100, 4, tenancy=Tenancy(priority=5)))
    step(core)
    return core


def test_a_head_whose_whole_prompt_is_the_budget_is_held_the_budget():
    core = long_prompt_running()
    core.add(seq("short", 16, 4, tenancy=Tenancy(priority=0)))
    assert ran_by_request(step(core)) == {"short": 16}


def test_a_head_whose_prompt_is_longer_than_the_budget_is_held_nothing():
    core = long_prompt_running()
    core.add(seq("short", 17, 4, tenancy=Tenancy(priority=0)))
    assert ran_by_request(step(core)) == {"long": 16}


def test_a_head_placed_on_another_worker_is_held_nothing_here():
    other = WorkerSpec("w1", num_blocks=62, block_size=4, max_context=128)
    core = long_prompt_running("priority", (SPEC, other))
    assert core.seqs["long"].worker == 0  # 64 blocks free against 62; then 60
    core.add(seq("short", 8, 4, tenancy=Tenancy(priority=0)))
    steps = step(core)  # w1 has more free KV now: short goes there, long keeps w0's budget
    assert ran_by_request(steps) == {"long": 16, "short": 8}
    assert core.seqs["short"].worker == 1


def test_a_head_of_the_same_priority_is_held_nothing():
    core = long_prompt_running()
    core.add(seq("peer", 8, 4, tenancy=Tenancy(priority=5)))
    assert ran_by_request(step(core)) == {"long": 16}


def test_a_head_that_cannot_be_admitted_is_held_nothing():
    core = long_prompt_running("deadline", max_running=1)  # deadline preempts nobody for it
    core.add(seq("short", 8, 4, tenancy=Tenancy(ttft_s=1)))
    assert core.waiting.outranks(core.waiting.peek(), core.seqs["long"])
    assert ran_by_request(step(core)) == {"long": 16}


def test_a_deadline_that_can_just_be_made_still_counts():
    clock = Clock(1.5)
    q = DeadlineRequestQueue(clock)
    q.eta = lambda s: 0.5
    q.add(waiting("chat", 0, ttft_s=2))  # due at 2, its prompt takes 0.5: start by 1.5
    q.add(waiting("batch", 0, ttft_s=60))
    assert ids(q) == ["chat", "batch"]
    clock.now = 1.75
    assert ids(q) == ["batch", "chat"]


def test_a_queue_no_core_predicts_for_counts_no_time_for_a_prompt_and_its_twin_keeps_the_core():
    clock = Clock(1.9)
    q = DeadlineRequestQueue(clock)
    q.add(waiting("chat", 0, ttft_s=2))
    q.add(waiting("batch", 0, ttft_s=60))
    assert ids(q) == ["chat", "batch"]  # no prediction: due at 2, it still can be at 1.9
    q.eta = lambda s: 0.5
    twin = q.emptied()
    twin.add(waiting("chat", 0, ttft_s=2))
    twin.add(waiting("batch", 0, ttft_s=60))
    assert ids(twin) == ["batch", "chat"]  # the twin predicts as its original: too late


def test_fcfs_ranks_no_waiting_request_above_a_running_one():
    q = FCFSRequestQueue()
    assert q.outranks(waiting("new", 1), running("old", 0)) is False


def test_fair_names_nobody_when_nobody_runs():
    q = FairRequestQueue()
    q.add(head := waiting("a0", 0, tenant="a"))
    assert q.victim(head, [], 4) is None


def test_fair_takes_no_peer_of_the_heads_priority_for_a_lower_one():
    """Below the head's priority only one, not worth preempting: the share decides, and a holds
    its share; its own newest request is no victim either."""
    q = FairRequestQueue()
    q.add(head := waiting("a9", 50, tenant="a", priority=1))
    low = running("c0", 5, tenant="c", priority=4)
    low.max_planned = low.num_planned
    run = [running("b0", 1, tenant="b", priority=1), running("a0", 7, tenant="a", priority=1)]
    assert q.victim(head, [*run, low], 3) is None


def test_fair_share_weighs_each_tenant_by_its_own_weight():
    q = FairRequestQueue()
    for tenant, weight in (("b", 3.0), ("c", 2.0), ("d", 0.5)):
        q.add(waiting(f"{tenant}9", 40, tenant=tenant, weight=weight))
    q.add(head := waiting("a9", 50, tenant="a"))  # the last to start waiting: the head on a tie
    assert q.peek() is head
    b = [running(f"b{i}", i, tenant="b") for i in range(4)]
    assert q.victim(head, b, 4) is b[3]  # b's share of 4 is 4 x 3/4 = 3: it holds 4
    c = [running(f"c{i}", i, tenant="c") for i in range(2)]
    assert q.victim(head, c, 4) is None  # c's share is 4 x 2/3: it holds 2, no more
    d = [running(f"d{i}", i, tenant="d") for i in range(2)]
    assert q.victim(head, d, 4) is d[1]  # d's share is 4 x 0.5/1.5: it holds 2


def test_fair_names_first_the_most_served_tenant_over_its_share_a_tenant_never_seen_at_zero():
    q = FairRequestQueue()
    q.add(head := waiting("a9", 50, tenant="a"))
    q.charge("b", 1, 0)  # b: 1; u never charged: 0
    u = [running(f"u{i}", i, tenant="u") for i in range(2)]
    b = [running(f"b{i}", 10 + i, tenant="b") for i in range(2)]
    assert q.victim(head, u + b, 4) is b[1]


def test_fair_ranks_a_waiting_head_against_running_tenants_seen_or_not():
    q = FairRequestQueue()
    q.add(head := waiting("a0", 0, tenant="a"))
    q.add(waiting("b0", 1, tenant="b"))  # b: lifted to a's 0, joined after a
    stranger = running("x0", 0, tenant="x")  # running since before a live switch: never seen
    assert q.outranks(head, stranger)  # 0 each: one that joined ranks before it
    assert not q.outranks(head, running("b1", 0, tenant="b"))  # b joined later: b first
    q.charge("a", 1, 0)  # a: 1; b and x: 0
    assert not q.outranks(head, stranger)
    q.charge("b", 2, 0)
    assert q.outranks(head, running("b1", 0, tenant="b"))  # 1 against 2


def test_under_deadline_a_running_prompt_leaves_the_budget_only_to_an_earlier_deadline():
    cases = (  # (the running prompt's target, the head's): whether the head is held its tokens
        (100.0, 1.0, True),
        (1.0, 100.0, False),
        (0.0, 0.0, False),  # neither has a deadline: no earlier one
    )
    for running_ttft, head_ttft, held in cases:
        clock = Clock(10.0)
        core = Scheduler(
            CoreConfig(queue_policy=QueuePolicy.DEADLINE, token_budget=16), [SPEC], clock=clock
        )
        core.add(seq("long", 100, 4, tenancy=Tenancy(ttft_s=running_ttft)))
        step(core)
        clock.now = 10.5
        core.add(seq("short", 8, 4, tenancy=Tenancy(ttft_s=head_ttft)))
        ran = ran_by_request(step(core))
        assert ran == ({"short": 8, "long": 8} if held else {"long": 16}), (running_ttft, ran)


def test_a_head_whose_uncached_rest_is_within_the_budget_is_held_that_rest():
    core = core_of("priority", token_budget=16)
    shared = list(range(3, 19))  # 16 tokens: 4 blocks
    core.add(Sequence("doc", [*shared, 90, 91, 92, 93], 1))
    step(core)
    step(core)  # its 5 blocks cached, it finishes
    core.add(seq("long", 100, 4, tenancy=Tenancy(priority=5)))
    step(core)
    assert list(core.seqs) == ["long"]
    core.add(Sequence("short", [*shared, *range(100, 108)], 4, tenancy=Tenancy(priority=0)))
    steps = step(core)  # 24 tokens, 16 cached: its 8 fit the budget, long takes the rest
    assert ran_by_request(steps) == {"short": 8, "long": 8}
    assert [e.cached_tokens for s in steps for e in s.admissions] == [16]


def test_a_shared_block_counts_as_room_only_once_every_victim_holding_it_goes():
    """The victims' room counts the blocks their going frees: a block low1 and low2 share is
    freed only by both going. Before, low2 alone was preempted in vain (its shared blocks stayed
    with low1, and top still waited); now both go in one step and top is admitted in it."""
    spec = WorkerSpec("w0", num_blocks=10, block_size=4, max_context=128)  # 40 positions
    core = core_of("priority", (spec,))
    shared = list(range(3, 11))  # 2 blocks
    low = Tenancy(priority=9)
    core.add(Sequence("low1", [*shared, 50, 51, 52, 53], 20, tenancy=low))
    step(core)
    core.add(Sequence("low2", [*shared, 60, 61, 62, 63], 20, tenancy=low))
    step(core)  # low2 shares low1's first 2 blocks: 5 blocks free
    assert core.seqs["low2"].num_computed == 12
    core.add(seq("top", 28, 2, tenancy=Tenancy(priority=0)))  # 7 blocks
    step(core)  # low2's going alone frees its own block (6 free): both must go
    assert core.seqs["low2"].preemptions == 1 and core.seqs["low1"].preemptions == 1
    assert core.seqs["top"].admitted_at is not None


def test_a_new_head_is_asked_although_nothing_ran_differently():
    core = four_low_and_a_peer()
    run_one(core, 0)  # top finds nobody on worker 0 (peer is its equal)
    core.add(seq("urgent", 4, 4, tenancy=Tenancy(priority=-1)))
    run_one(core, 0)  # a new head: peer is below it
    assert core.seqs["peer"].preemptions == 1 and core.seqs["urgent"].worker == 0


def test_fair_preempts_no_request_that_would_take_its_place_back_at_once():
    """A head below its tenant's share preempts a tenant over its share only if it outranks the
    victim: here B's counter is lower than A's (B also waits at another level, so it is not
    lifted), so B1, preempted, was the head again and took its place back in the same step,
    step after step (41 preemptions in 42 steps), while A1 waited anyway. Now A1 waits without
    preempting, and preempts once B's service passes A's."""
    spec = WorkerSpec("w0", num_blocks=1000, block_size=4, max_context=4096)
    core = core_of("fair", (spec,), max_running=2, token_budget=64, decode_steps=1)

    def of(rid, prompt, out, tenant, weight, priority):
        t = Tenancy(tenant=tenant, weight=weight, priority=priority)
        return Sequence(rid, prompt, out, ignore_eos=True, tenancy=t)

    core.add(of("A0", list(range(3, 163)), 200, "A", 2, 0))
    step(core)
    core.add(b1 := of("B1", list(range(300, 320)), 100, "B", 1, 1))
    step(core)
    core.add(of("B2", list(range(600, 604)), 5, "B", 1, 2))
    core.add(a1 := of("A1", list(range(500, 508)), 5, "A", 2, 1))
    for _ in range(300):
        before = b1.preemptions
        step(core)
        if b1.preemptions > before:  # a preemption the head got the place of
            assert a1.admitted_at is not None and b1.status is SeqStatus.WAITING
        if a1.admitted_at is not None:
            break
    assert a1.admitted_at is not None and b1.preemptions <= 1


def test_back_from_priority_the_newest_running_request_is_preempted_first():
    """Switched live from priority to fcfs, the running lists go back to arrival order: KV
    preemption takes the newest request, not the lowest priority one of the old order."""
    spec = WorkerSpec("w0", num_blocks=12, block_size=1, max_context=4096)
    core = core_of("priority", (spec,), token_budget=64, decode_steps=1, prefix_caching=False)
    old = Sequence("old_low", list(range(10, 14)), 8, ignore_eos=True, tenancy=Tenancy(priority=5))
    core.add(old)
    step(core)
    new = Sequence("new_top", list(range(20, 24)), 8, ignore_eos=True, tenancy=Tenancy(priority=0))
    core.add(new)
    step(core)
    assert [s.request_id for s in core.workers[0].running] == ["new_top", "old_low"]
    core.reconfigure(apply(core.config, {"queue_policy": "fcfs"}))
    assert [s.request_id for s in core.workers[0].running] == ["old_low", "new_top"]
    for _ in range(10):
        if core.preemptions:
            break
        step(core)
    assert new.preemptions == 1 and old.preemptions == 0


def test_deadline_lists_its_requests_in_the_order_it_admits_them():
    """A request deeper in the hopeful heap that can no longer make its deadline is listed with
    the late ones (status and explain show this order), as the pops will take it."""
    now = [0.0]
    q = create_request_queue(QueuePolicy.DEADLINE, lambda: now[0])
    etas = {"X": 0.0, "Y": 5.0, "Z": 0.0}
    q.eta = lambda s: etas[s.request_id]
    for rid, ttft in (("X", 10.0), ("Y", 11.0), ("Z", 12.0)):
        tenancy = Tenancy(slo_class="c", ttft_s=ttft)
        q.add(Sequence(rid, [3, 4], 4, arrival=0.0, tenancy=tenancy))
    now[0] = 7.0  # Y: 11 - 5 = 6 < 7, it can no longer make its deadline
    listed = [s.request_id for s in q]
    popped = [q.pop().request_id for _ in range(3)]
    assert listed == popped == ["X", "Z", "Y"]


def test_fair_preempts_no_tenant_that_would_win_the_tie_on_its_return():
    """Just after a live switch every counter is 0: B, running but not waiting, would be lifted
    to the head's counter on its victim's return and win the tie, taking the place back. The
    head waits a step, until B's service passes its tenant's, then preempts once."""
    core = core_of("fcfs", (WorkerSpec("w0", 500, 4, 4096),), max_running=2, decode_steps=1)
    b = [Sequence(f"B{i}", list(range(300 + 20 * i, 320 + 20 * i)), 50, ignore_eos=True,
                  tenancy=Tenancy(tenant="B")) for i in range(2)]  # fmt: skip
    for s in b:
        core.add(s)
    step(core)
    core.reconfigure(apply(core.config, {"queue_policy": "fair"}))
    core.add(a1 := Sequence("A1", [7, 8, 9], 3, ignore_eos=True, tenancy=Tenancy(tenant="A")))
    for _ in range(10):
        step(core)
        if a1.admitted_at is not None:
            break
    assert a1.admitted_at is not None and core.preemptions == 1
