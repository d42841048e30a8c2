"""The scheduler service's hand-over of token events to request streams: a step's events may wait
a moment (so that the next step's requests reach the workers first), but never reorder."""

from __future__ import annotations

import asyncio

from llmserve.v1 import common_pb2
from scheduler_svc.output import Event
from scheduler_svc.sequence import Finish
from scheduler_svc.service import SchedulerService


def bare_service() -> SchedulerService:
    """Only the dispatch state: no core, no workers."""
    service = SchedulerService.__new__(SchedulerService)
    service.streams = {}
    service.outbox = []
    service.flush_handle = None
    return service


def drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_delayed_events_arrive_after_the_delay_merged_per_request() -> None:
    async def scenario() -> tuple[list, list]:
        service = bare_service()
        queue: asyncio.Queue = asyncio.Queue()
        service.streams["a"] = queue
        service._dispatch([Event("a", token_id=5), Event("a", token_id=6)], delay=0.02)
        before = drain(queue)
        await asyncio.sleep(0.05)
        return before, drain(queue)

    before, after = asyncio.run(scenario())
    assert before == []
    assert len(after) == 1 and list(after[0].token_ids) == [5, 6]


def test_an_immediate_dispatch_first_hands_over_the_delayed_events() -> None:
    """A step's tokens are delayed; the request then finishes and the loop goes idle, which
    dispatches at once: the stream must see the tokens before the finish, and each only once."""

    async def scenario() -> list:
        service = bare_service()
        queue: asyncio.Queue = asyncio.Queue()
        service.streams["a"] = queue
        service._dispatch([Event("a", token_id=7)], delay=0.5)
        service._dispatch([Event("a", finish=Finish.LENGTH)])
        got = drain(queue)
        await asyncio.sleep(0.6)  # the cancelled timer must not hand anything over again
        return got + drain(queue)

    events = asyncio.run(scenario())
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == [7]
    assert events[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
