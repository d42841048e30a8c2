"""The Session stream (scheduler_svc/session.py, gateway/scheduler_session.py): a gateway's
requests on one stream, each dispatch's events for all of them in one message. The scheduler's
half runs on a real gRPC server on loopback in front of a stand-in for the service (its accept,
its relay, an abort that records), the gateway's half is the real SchedulerSession."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.scheduler_session import SchedulerSession
from llmcommon.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.output import Event
from scheduler_svc.relay import EventRelay
from scheduler_svc.sequence import Finish
from scheduler_svc.service import SchedulerService
from scheduler_svc.session import Rejected, Session

BOUND = 30  # seconds: bounds a failure only, every wait below ends on an event


class FakeCore:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, rid: str) -> list:
        self.aborted.append(rid)
        return [rid]


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """The real Session handler over a stand-in service: it queues what it is given, refuses
    prompts that start with 0 and counts the messages it writes."""

    Session = SchedulerService.Session
    drop = SchedulerService.drop

    def __init__(self) -> None:
        self.streams: dict = {}
        self.relay = EventRelay(self.streams, 0)
        self.core = FakeCore()
        self.accepted: list[str] = []
        self.wakes = 0
        self.stopping = asyncio.Event()  # the server's: set at SIGTERM

    def accept(self, request) -> tuple[str, bool]:
        if request.prompt_token_ids[0] == 0:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full")
        if list(request.resume_token_ids[-1:]) == [2]:  # resumed after its stop id
            return request.request_id, False
        self.accepted.append(request.request_id)
        return request.request_id, True

    def wake_all(self) -> None:
        self.wakes += 1


def submit(rid: str, first: int = 5, resume: tuple = ()) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id=rid, prompt_token_ids=[first, 6], resume_token_ids=list(resume)
    )


async def started(fake: FakeScheduler):
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, SchedulerSession(scheduler_pb2_grpc.SchedulerStub(channel))


async def until(condition) -> None:
    async with asyncio.timeout(BOUND):
        while not condition():
            await asyncio.sleep(0.005)


async def collect(call) -> list[scheduler_pb2.TokenEvent]:
    return [event async for event in call]


def test_one_message_carries_a_dispatch_for_every_request_and_each_gets_its_own() -> None:
    async def scenario():
        fake = FakeScheduler()
        server, channel, session = await started(fake)
        try:
            calls = [session.submit(submit(f"r{i}"), None) for i in range(3)]
            readers = [asyncio.create_task(collect(c)) for c in calls]
            await until(lambda: len(fake.streams) == 3)
            fake.relay.dispatch([("r0", 10), ("r1", 11), ("r2", 12)])
            fake.relay.dispatch([("r0", 20), ("r1", 21)])
            done = [Event("r0", finish=Finish.LENGTH), Event("r1", token_id=31, finish=Finish.STOP)]
            fake.relay.dispatch(done)
            fake.relay.dispatch([Event("r2", finish=Finish.CANCELLED)])
            async with asyncio.timeout(BOUND):
                events = await asyncio.gather(*readers)
            return fake, calls, events
        finally:
            await channel.close()
            await server.stop(0)

    fake, calls, events = asyncio.run(scenario())
    tokens = [[t for e in evs for t in e.token_ids] for evs in events]
    assert tokens == [[10, 20], [11, 21, 31], [12]]
    finishes = [evs[-1].finish_reason for evs in events]
    assert finishes == [
        common_pb2.FINISH_REASON_LENGTH,
        common_pb2.FINISH_REASON_STOP,
        common_pb2.FINISH_REASON_CANCELLED,
    ]
    assert all(c.accepted for c in calls)
    assert fake.streams == {}  # a finished request leaves the relay's streams
    assert fake.core.aborted == []  # nobody was cancelled


def test_a_dispatch_for_many_requests_is_one_message() -> None:
    """What the scheduler writes: the session's next message holds every request's news of a
    dispatch, where Submit calls would write one message each."""

    async def scenario():
        fake = FakeScheduler()
        session = Session(fake)
        for i in range(64):
            session.submit(submit(f"r{i}"))
        first = await session.next_message()
        fake.relay.dispatch([(f"r{i}", 100 + i) for i in range(64)])
        second = await session.next_message()
        return first, second

    first, second = asyncio.run(scenario())
    assert [e.accepted for e in first.events] == [True] * 64
    news = sorted((e.request_id, list(e.event.token_ids)) for e in second.events)
    assert news == sorted((f"r{i}", [100 + i]) for i in range(64))


def test_a_refusal_raises_its_status_and_a_resubmission_that_had_ended_just_ends() -> None:
    async def scenario():
        fake = FakeScheduler()
        server, channel, session = await started(fake)
        try:
            refused = session.submit(submit("full", first=0), None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async with asyncio.timeout(BOUND):
                    await collect(refused)
            ended = session.submit(submit("ended", resume=(7, 2)), None)
            async with asyncio.timeout(BOUND):
                events = await collect(ended)
            return err.value, refused, events, ended
        finally:
            await channel.close()
            await server.stop(0)

    err, refused, events, ended = asyncio.run(scenario())
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "the queue is full"
    assert not refused.accepted and not ended.accepted
    assert [e.finish_reason for e in events] == [common_pb2.FINISH_REASON_STOP]


def test_cancel_and_deadline_abort_the_request_at_the_scheduler() -> None:
    async def scenario():
        fake = FakeScheduler()
        server, channel, session = await started(fake)
        try:
            left = session.submit(submit("left"), None)
            late = session.submit(submit("late"), 0.2)
            # not both: on a slow host "late"'s deadline may pass first (its cancel follows its
            # submission up the stream, so the scheduler aborts it all the same)
            await until(lambda: "left" in fake.streams)
            left.cancel()
            with pytest.raises(asyncio.CancelledError):
                async with asyncio.timeout(BOUND):
                    await collect(left)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async with asyncio.timeout(BOUND):
                    await collect(late)
            await until(lambda: len(fake.core.aborted) == 2)
            return fake, err.value
        finally:
            await channel.close()
            await server.stop(0)

    fake, err = asyncio.run(scenario())
    assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert sorted(fake.core.aborted) == ["late", "left"]
    assert fake.streams == {}


def test_a_broken_session_fails_its_requests_as_accepted_and_the_next_opens_a_new_one() -> None:
    """The scheduler goes away: every request on the stream fails UNAVAILABLE and says it was
    accepted (the gateway's core then resubmits it); the next submission opens a new stream."""

    async def scenario():
        fake = FakeScheduler()
        server, channel, session = await started(fake)
        try:
            held = [session.submit(submit(f"h{i}"), None) for i in range(2)]
            await until(lambda: len(fake.streams) == 2)
            fake.relay.dispatch([("h0", 1)])
            first = session.stream
            await server.stop(0)
            errors = []
            for call in held:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async with asyncio.timeout(BOUND):
                        await collect(call)
                errors.append(err.value.code())
            accepted = [dict(await c.initial_metadata()) != {} for c in held]
            later = session.submit(submit("later"), None)
            return errors, accepted, session.stream is not first, later
        finally:
            await channel.close()

    errors, accepted, reopened, _ = asyncio.run(scenario())
    assert errors == [grpc.StatusCode.UNAVAILABLE] * 2
    assert accepted == [True, True]
    assert reopened


def test_the_gateway_leaving_cancels_every_request_still_on_the_session() -> None:
    async def scenario():
        fake = FakeScheduler()
        server, channel, session = await started(fake)
        try:
            for i in range(3):
                session.submit(submit(f"g{i}"), None)
            await until(lambda: len(fake.streams) == 3)
            session.close()
            await until(lambda: len(fake.core.aborted) == 3)
            return fake
        finally:
            await channel.close()
            await server.stop(0)

    fake = asyncio.run(scenario())
    assert sorted(fake.core.aborted) == ["g0", "g1", "g2"]
    assert fake.streams == {}


def test_a_stopping_scheduler_refuses_new_requests_and_ends_the_session_when_its_last_finishes():
    """At SIGTERM the requests in flight finish on the session; a new one is refused with
    UNAVAILABLE; then the session ends, so the scheduler exits without waiting out its drain."""

    async def scenario():
        fake = FakeScheduler()
        server, channel, session = await started(fake)
        try:
            held = session.submit(submit("held"), None)
            reader = asyncio.create_task(collect(held))
            await until(lambda: len(fake.streams) == 1)
            stream = session.stream
            fake.stopping.set()
            original = fake.accept

            def accept(request):  # as SchedulerService.accept does while it drains
                if fake.stopping.is_set():
                    raise Rejected(grpc.StatusCode.UNAVAILABLE, "the scheduler is stopping")
                return original(request)

            fake.accept = accept
            refused = session.submit(submit("new"), None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async with asyncio.timeout(BOUND):
                    await collect(refused)
            assert not stream.task.done()  # still open for the request in flight
            fake.relay.dispatch([Event("held", token_id=9, finish=Finish.LENGTH)])
            async with asyncio.timeout(BOUND):
                events = await reader
                await stream.task  # the scheduler ended the stream
            return err.value, events, session.stream
        finally:
            await channel.close()
            await server.stop(0)

    err, events, after = asyncio.run(scenario())
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert [list(e.token_ids) for e in events] == [[9]]
    assert after is None  # the next request opens a new stream (which a stopped server refuses)
