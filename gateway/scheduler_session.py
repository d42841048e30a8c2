"""The gateway's requests on one Session stream to the scheduler (scheduler_svc/session.py): each
step's tokens for all of them come in one message, where a Submit call per request takes one
message per request per step. A request on it is shaped as its Submit call was (iterate its
events, cancel it, ask whether the scheduler accepted it), so the gateway's core treats both
alike: a stream that breaks fails every request on it with the stream's status, as the scheduler's
death fails every Submit call, and the core resubmits those the scheduler had accepted."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import grpc

from llmcommon.protocol import ACCEPTED_KEY
from llmcommon.v1 import common_pb2, scheduler_pb2

_CANCELLED = object()  # queued by cancel(): the reader raises CancelledError, as a call's does
_END = object()


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class SessionCall:
    """One request on the session."""

    def __init__(self, stream: _Stream, rid: str, timeout: float | None) -> None:
        self.stream, self.rid = stream, rid
        self.items: deque = deque()  # TokenEvents, then at most one end
        self.arrived = asyncio.Event()
        self.accepted = False
        self.over = False  # finished, failed or cancelled: nothing more comes or goes
        self.timer = None
        if timeout is not None:  # the client's deadline, as Submit's timeout= was
            self.timer = asyncio.get_running_loop().call_later(max(timeout, 0), self._expire)

    def __aiter__(self) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        items = self.items
        while True:
            while not items:
                self.arrived.clear()
                await self.arrived.wait()
            item = items.popleft()
            if item is _END:
                return
            if item is _CANCELLED:
                raise asyncio.CancelledError()
            if isinstance(item, grpc.aio.AioRpcError):
                raise item
            while items and type(items[0]) is scheduler_pb2.TokenEvent:
                item.MergeFrom(items.popleft())  # what queued behind it, as one message
            yield item
            if item.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                return

    async def initial_metadata(self) -> tuple:
        return ((ACCEPTED_KEY, "1"),) if self.accepted else ()

    def cancel(self) -> bool:
        if self.over:
            return False
        self._end(_CANCELLED)
        self.stream.send(scheduler_pb2.SessionRequest(cancel={"request_id": self.rid}))
        return True

    def _expire(self) -> None:
        if not self.over:
            self._end(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self.stream.send(scheduler_pb2.SessionRequest(cancel={"request_id": self.rid}))

    def deliver(self, news: scheduler_pb2.RequestEvent) -> None:
        if self.over:
            return
        if news.accepted:
            self.accepted = True
        if news.code:
            code = _CODES.get(news.code, grpc.StatusCode.UNKNOWN)
            self._end(rpc_error(code, news.details))
        elif news.HasField("event"):
            self.items.append(news.event)
            self.arrived.set()
            if news.event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                self._end(_END)

    def fail(self, err: grpc.aio.AioRpcError) -> None:
        if not self.over:
            self._end(err)

    def abandon(self, err: grpc.aio.AioRpcError) -> None:
        """Fail it here with `err` and cancel it there (a hung scheduler reads the cancel when
        it runs again): the gateway resubmits it elsewhere."""
        if not self.over:
            self._end(err)
            self.stream.send(scheduler_pb2.SessionRequest(cancel={"request_id": self.rid}))

    def _end(self, item) -> None:
        self.over = True
        self.stream.calls.pop(self.rid, None)
        if self.timer is not None:
            self.timer.cancel()
        self.items.append(item)
        self.arrived.set()


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _Stream:
    """One Session call and the requests on it."""

    def __init__(self, stub, on_end) -> None:
        self.calls: dict[str, SessionCall] = {}
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.call = stub.Session(self._requests())
        self.task = asyncio.create_task(self._read(on_end))

    async def _requests(self):
        while (request := await self.outbox.get()) is not None:
            yield request

    def send(self, request: scheduler_pb2.SessionRequest) -> None:
        self.outbox.put_nowait(request)

    async def _read(self, on_end) -> None:
        err = rpc_error(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the session")
        try:
            async for message in self.call:
                for news in message.events:
                    call = self.calls.get(news.request_id)
                    if call is not None:
                        call.deliver(news)
        except grpc.aio.AioRpcError as e:
            err = _lost(e)
        except asyncio.CancelledError:
            err = rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the session")
            raise
        finally:
            on_end(self)
            for call in list(self.calls.values()):
                call.fail(err)


def _lost(err: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """The error every request on a broken session gets. gRPC's core reports some broken
    connections as INTERNAL ("Internal error from Core"; the scheduler never answers INTERNAL):
    the scheduler is lost, as for UNAVAILABLE, and the requests it accepted are resubmitted."""
    if err.code() is grpc.StatusCode.INTERNAL:
        return rpc_error(grpc.StatusCode.UNAVAILABLE, f"the session broke: {err.details()}")
    return err


class SchedulerSession:
    """The gateway's session: opened at the first request, opened again after it breaks."""

    def __init__(self, stub) -> None:
        self.stub = stub
        self.stream: _Stream | None = None

    def submit(self, submit: scheduler_pb2.SubmitRequest, timeout: float | None) -> SessionCall:
        if self.stream is None:
            self.stream = _Stream(self.stub, self._ended)
        call = SessionCall(self.stream, submit.request_id, timeout)
        self.stream.calls[submit.request_id] = call
        self.stream.send(scheduler_pb2.SessionRequest(submit=submit))
        return call

    def _ended(self, stream: _Stream) -> None:
        if self.stream is stream:
            self.stream = None

    def close(self) -> None:
        if self.stream is not None:
            self.stream.call.cancel()
            self.stream = None
