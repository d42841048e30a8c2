"""The waiting queue's type: FCFS order, a preempted request back in front, removal, and the
core admitting through it alone."""

import pytest

from scheduler_svc.config import CoreConfig, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.request_queue import (
    FCFSRequestQueue,
    QueuePolicy,
    RequestQueue,
    create_request_queue,
)
from scheduler_svc.sequence import Sequence


def seq(rid: str, arrival: float = 0.0) -> Sequence:
    return Sequence(rid, [1, 2, 3], 4, arrival=arrival)


def ids(queue: RequestQueue) -> list[str]:
    return [s.request_id for s in queue]


def test_fcfs_admits_in_arrival_order_and_pops_the_head():
    queue = create_request_queue(QueuePolicy.FCFS)
    a, b, c = seq("a", 1.0), seq("b", 2.0), seq("c", 3.0)
    for s in (a, b, c):
        queue.add(s)
    assert isinstance(queue, FCFSRequestQueue) and queue.policy is QueuePolicy.FCFS
    assert ids(queue) == ["a", "b", "c"] and len(queue) == 3 and queue
    assert queue.peek() is a and len(queue) == 3  # peeking takes nothing out
    assert queue.pop() is a and ids(queue) == ["b", "c"]


def test_a_preempted_request_goes_back_in_front_of_everyone():
    queue = create_request_queue("fcfs")
    b, c, a = seq("b", 2.0), seq("c", 3.0), seq("a", 1.0)
    queue.add(b)
    queue.add(c)
    queue.prepend(a)
    assert ids(queue) == ["a", "b", "c"] and queue.peek() is a
    assert queue.oldest_arrival() == 1.0


def test_one_admitted_out_of_arrival_order_back_in_front_is_not_the_oldest():
    """After a live switch to fcfs from an ordering that admitted `run` before `old`, `run`
    preempted goes in front of `old`: the head, but not the oldest (the oldest-wait gauge had
    shown `run`'s wait; tenants sweep F4)."""
    queue = create_request_queue("fcfs")
    old, run, new = seq("old", 1.0), seq("run", 2.0), seq("new", 3.0)
    queue.add(old)
    queue.add(new)
    queue.prepend(run)
    assert queue.peek() is run and queue.oldest() is old and queue.oldest_arrival() == 1.0
    queue.remove(old)
    assert queue.oldest() is run
    for s in (run, new):
        queue.remove(s)
    assert queue.oldest() is None
    queue.add(new)
    queue.prepend(old)  # the usual case again: the head is the oldest
    assert queue.oldest() is old and not queue._unordered


def test_remove_takes_one_out_and_keeps_the_order_of_the_rest():
    queue = create_request_queue()
    a, b, c = seq("a"), seq("b"), seq("c")
    for s in (a, b, c):
        queue.add(s)
    queue.remove(b)
    assert ids(queue) == ["a", "c"] and b not in queue
    with pytest.raises(ValueError):
        queue.remove(b)


def test_an_empty_queue_is_false_has_no_head_and_no_oldest_arrival():
    queue = create_request_queue()
    assert not queue and len(queue) == 0 and queue.oldest_arrival() is None
    with pytest.raises(IndexError):
        queue.peek()
    with pytest.raises(IndexError):
        queue.pop()


def test_emptied_is_a_new_empty_queue_of_the_same_ordering():
    queue = create_request_queue()
    queue.add(seq("a"))
    other = queue.emptied()
    assert type(other) is type(queue) and not other and len(queue) == 1


def test_an_unknown_policy_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown queue policy 'lifo'; known: fcfs"):
        create_request_queue("lifo")


def test_the_core_holds_its_waiting_requests_in_the_queue_type():
    core = Scheduler(CoreConfig(token_budget=8, max_running=1), [WorkerSpec("w", 8, 4, 64)])
    a, b = seq("a"), seq("b")
    core.add(a)
    core.add(b)
    assert isinstance(core.waiting, RequestQueue) and ids(core.waiting) == ["a", "b"]
    core.schedule_all()
    assert ids(core.waiting) == ["b"]  # a runs; the running limit holds b
    core.abort("b")
    assert not core.waiting and core.snapshot().waiting_tokens == 0
