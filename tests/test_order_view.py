"""`status --explain` names the queue's ordering: the head's standing, and when the oldest request
is not the head, who is ahead of it and why (tenant, priority, counter, deadline)."""

from __future__ import annotations

import asyncio

from llmcommon.tenancy import Tenancy
from llmserve.client import explanation_dict
from llmserve.status_text import explanation_text
from scheduler_svc.admin import explanation
from scheduler_svc.config import CoreConfig, QueuePolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.order_view import order_view
from tests.sim import seq, step


def busy(policy: QueuePolicy) -> Scheduler:
    core = Scheduler(CoreConfig(queue_policy=policy, max_running=1), [WorkerSpec("w0", 64, 4, 128)])
    core.add(seq("run", 4, 30, tenancy=Tenancy(tenant="batch")))
    step(core)
    core.add(seq("old", 4, 4, tenancy=Tenancy(tenant="batch", priority=3)))
    for i in range(3):
        core.add(seq(f"new{i}", 4, 4, tenancy=Tenancy(tenant="chat", priority=1)))
    step(core)
    return core


def test_the_view_names_the_oldest_and_who_is_ahead_of_it_under_priority():
    core = busy(QueuePolicy.PRIORITY)
    view = order_view(core.waiting, core.clock())
    assert view.policy == "priority" and view.head.request_id == "new0"
    assert view.oldest.request_id == "old" and view.oldest.standing["priority"] == "3"
    assert [s.request_id for s in view.ahead] == ["new0", "new1", "new2"]
    assert view.ahead[0].standing == {"tenant": "chat", "priority": "1"}


def test_under_fcfs_the_oldest_is_the_head_and_nobody_is_ahead():
    core = busy(QueuePolicy.FCFS)
    view = order_view(core.waiting, core.clock())
    assert view.head.request_id == "old" and view.oldest is None and not view.ahead


def test_explain_over_the_wire_and_as_text_names_the_counters_under_fair():
    core = busy(QueuePolicy.FAIR)
    msg = asyncio.run(explanation(core))
    assert msg.queue_policy == "fair"
    e = explanation_dict(msg)
    assert e["head_standing"]["standing"]["tenant"] == "chat"
    assert e["oldest"]["request_id"] == "old" and "counter" in e["oldest"]["standing"]
    text = explanation_text({"explanation": e})
    assert "order: fair; the head is new0 (tenant chat, priority 1, counter" in text
    assert "the oldest, old (tenant batch, priority 3, counter" in text and "behind: new0" in text
