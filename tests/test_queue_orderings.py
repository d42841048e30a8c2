"""The orderings other than FCFS, each a RequestQueue class: priority (vLLM's), fair share
between tenants (VTC) and deadlines; what each names as the head, puts back, and may preempt."""

from __future__ import annotations

import math

import pytest

from llmcommon.tenancy import Tenancy
from scheduler_svc.request_queue import (
    DeadlineRequestQueue,
    FairRequestQueue,
    PriorityRequestQueue,
    QueuePolicy,
    create_request_queue,
)
from scheduler_svc.sequence import SeqStatus, Sequence


def seq(rid: str, arrival: float, prompt: int = 4, **tenancy) -> Sequence:
    s = Sequence(rid, [1] * prompt, 8, arrival=arrival, tenancy=Tenancy(**tenancy))
    s.status = SeqStatus.WAITING
    return s


def running(rid: str, arrival: float, **tenancy) -> Sequence:
    s = seq(rid, arrival, **tenancy)
    s.status, s.max_planned = SeqStatus.RUNNING, 100
    return s


def ids(queue) -> list[str]:
    return [s.request_id for s in queue]


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_every_policy_has_a_class_and_an_unknown_one_names_them_all():
    for policy in QueuePolicy:
        assert create_request_queue(policy).policy is policy
    with pytest.raises(ValueError, match="fcfs, priority, fair, deadline"):
        create_request_queue("edf")


def test_priority_serves_the_lowest_value_first_and_ties_by_arrival():
    q = PriorityRequestQueue()
    for s in (seq("a", 1, priority=5), seq("b", 2, priority=-1), seq("c", 3, priority=5)):
        q.add(s)
    q.add(seq("d", 0.5, priority=-1))
    assert ids(q) == ["d", "b", "a", "c"] and q.peek().request_id == "d"
    assert q.oldest().request_id == "d"
    assert q.pop().request_id == "d" and ids(q) == ["b", "a", "c"] and len(q) == 3


def test_priority_puts_preempted_requests_in_front_of_their_level_the_last_first():
    q = PriorityRequestQueue()
    early, late = seq("early", 1, priority=1), seq("late", 2, priority=1)
    q.add(seq("waiting", 0.5, priority=1))
    q.add(seq("top", 3, priority=0))
    q.prepend(early)
    q.prepend(late)
    assert ids(q) == ["top", "late", "early", "waiting"]


def test_priority_puts_a_preempted_request_back_by_its_rank_and_removes_cleanly():
    q = PriorityRequestQueue()
    a, b, c = seq("a", 1, priority=1), seq("b", 2, priority=0), seq("c", 3, priority=1)
    for s in (b, c):
        q.add(s)
    q.prepend(a)  # preempted: ahead of c (same priority, earlier) but behind b
    assert ids(q) == ["b", "a", "c"]
    q.remove(b)
    assert ids(q) == ["a", "c"] and q.peek() is a and q.oldest() is a
    with pytest.raises(ValueError):
        q.remove(b)
    q.pop(), q.pop()
    assert not q and q.oldest() is None
    with pytest.raises(IndexError):
        q.peek()


def test_priority_names_the_lowest_running_newest_first_and_never_an_equal_one():
    q = PriorityRequestQueue()
    run = sorted(
        [running("x", 1, priority=0), running("y", 2, priority=3), running("z", 3, priority=3)],
        key=q.running_key,
    )
    assert q.victim(seq("h", 9, priority=1), run, 3).request_id == "z"
    assert q.victim(seq("h", 9, priority=3), run, 3) is None  # equal: it waits its turn
    run[-1].max_planned = run[-1].num_planned  # z's last token is in flight: not worth it
    assert q.victim(seq("h", 9, priority=1), run, 3).request_id == "y"


def test_fair_serves_the_tenant_with_the_least_weighted_service():
    q = FairRequestQueue()
    for i in range(3):
        q.add(seq(f"a{i}", i, tenant="a"))
    q.charge("a", 40, 0)
    q.add(seq("b0", 10, tenant="b"))
    # b arrives while a waits: lifted to a's counter (40), the tie goes to the newcomer
    assert q.counters["b"] == 40 and q.peek().request_id == "b0"
    assert q.outranks(q.peek(), seq("a9", 0, tenant="a"))
    q.charge("b", 10, 0)
    assert q.peek().request_id == "a0"
    q.charge("a", 60, 0)
    assert q.peek().request_id == "b0" and not q.outranks(q.peek(), seq("b9", 0, tenant="b"))
    q.charge("b", 50, 30)  # 50 + 50 + 2 * 30 = 160 > 100
    assert q.peek().request_id == "a0"
    assert q.standing(q.peek())["counter"] == "100"


def test_fair_divides_service_by_weight():
    q = FairRequestQueue()
    q.add(seq("a0", 0, tenant="a", weight=2.0))
    q.add(seq("b0", 1, tenant="b", weight=1.0))
    q.charge("a", 150, 0)  # 75 per unit of weight
    q.charge("b", 100, 0)
    assert q.peek().request_id == "a0"


def test_fair_lifts_a_tenant_that_starts_waiting_again_to_the_least_counter_waiting():
    q = FairRequestQueue()
    q.add(seq("a0", 0, tenant="a"))
    q.add(seq("b0", 1, tenant="b"))
    q.charge("a", 1000, 0)
    q.charge("b", 10, 0)
    q.remove(q.peek())  # b0 leaves: b has banked nothing it may spend later
    q.charge("a", 500, 0)  # a served alone meanwhile
    q.add(seq("b1", 2, tenant="b"))
    assert q.counters["b"] == 1500 and q.counters["a"] == 1500
    assert q.pop().request_id == "b1"  # on the tie the lift made, the newcomer first
    assert ids(q) == ["a0"]
    q.pop()  # nobody waits: the next newcomer starts from the last counter to leave
    q.add(seq("c0", 3, tenant="c"))
    assert q.counters["c"] == 1500


def test_fair_orders_priority_levels_first_and_tenants_inside_a_level():
    q = FairRequestQueue()
    q.add(seq("a0", 0, tenant="a", priority=1))
    q.add(seq("b0", 1, tenant="b", priority=0))
    q.add(seq("b1", 2, tenant="b", priority=0))
    q.charge("b", 10_000, 0)
    assert q.peek().request_id == "b0"  # the better level first, however served
    assert ids(q) == ["b0", "b1", "a0"] and len(q) == 3
    q.prepend(q.pop())
    assert ids(q)[0] == "b0"


def test_fair_preempts_only_for_a_tenant_below_its_weighted_share_from_one_above_it():
    q = FairRequestQueue()
    burst = [running(f"b{i}", i, tenant="b") for i in range(4)]
    q.add(seq("a0", 10, tenant="a"))
    q.add(seq("b9", 9, tenant="b"))
    q.charge("b", 5000, 0)
    assert q.victim(q.peek(), burst, 4).request_id == "b3"  # the newest of the most served
    even = burst[:2] + [running(f"a{i}", 20 + i, tenant="a") for i in range(2)]
    assert q.victim(seq("a5", 30, tenant="a"), even, 4) is None  # a holds its share already
    light = seq("c0", 30, tenant="c", weight=0.2)
    q.add(light)  # a share of 4 x 0.2 / 1.2 < 1 running place: it takes none from b
    assert q.victim(light, burst, 4) is None


def test_deadline_serves_the_earliest_deadline_that_can_still_be_met():
    clock = Clock()
    q = DeadlineRequestQueue(clock)
    q.add(seq("batch", 0, ttft_s=60))
    q.add(seq("chat", 1, ttft_s=1))
    q.add(seq("free", 0.5))  # no TTFT target
    assert ids(q) == ["chat", "batch", "free"]
    clock.now = 2.5  # chat's deadline (2) has passed: behind those that can make theirs
    assert ids(q) == ["batch", "free", "chat"] and q.peek().request_id == "batch"
    assert q.standing(q.peek())["deadline_s"] == "+57.500"
    q.prepend(run := seq("back", 0.1))
    assert q.peek() is run and q.oldest().request_id == "batch"
    assert [q.pop().request_id for _ in range(4)] == ["back", "batch", "free", "chat"]
    assert not q and math.isinf(Tenancy().deadline(0))


def test_deadline_removes_from_front_hopeful_and_late_alike():
    clock = Clock()
    q = DeadlineRequestQueue(clock)
    a, b, c = seq("a", 0, ttft_s=1), seq("b", 0, ttft_s=5), seq("c", 0)
    for s in (a, b):
        q.add(s)
    q.prepend(c)
    clock.now = 2
    q.peek()  # a moves behind
    for s in (a, c, b):
        q.remove(s)
    assert not q and len(q) == 0
    with pytest.raises(ValueError):
        q.remove(a)


def test_an_emptied_queue_keeps_its_ordering_and_clock():
    clock = Clock()
    q = DeadlineRequestQueue(clock)
    twin = q.emptied()
    assert type(twin) is DeadlineRequestQueue and twin.clock is clock and not twin


def test_deadline_puts_behind_a_request_whose_prompt_cannot_be_done_in_time():
    clock = Clock()
    q = DeadlineRequestQueue(clock)
    q.eta = lambda s: 0.001 * len(s.prompt_ids)  # a millisecond per prompt token
    long, short = seq("long", 0, prompt=3000, ttft_s=2), seq("short", 0.5, prompt=10, ttft_s=2)
    q.add(long)
    q.add(short)
    # long's deadline (2 s) comes first, but its 3 s prompt cannot make it: it goes behind
    assert ids(q) == ["short", "long"] and q.peek() is short
    q.eta = lambda s: 0.0
    q.add(seq("early", 0.1, prompt=3000, ttft_s=2))
    assert q.peek().request_id == "early"  # without a prediction only a passed deadline counts
