"""One gateway's requests on one stream (the Session RPC): submissions and cancels come up, and
each step's events for all of them go down as one message. A request stream (Submit) costs one
gRPC message per request per step on each side, which is most of what the stack spends per
token outside the model (docs/benchmarks.md, "The stack's cost per token")."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from llmcommon.errors import bounded
from llmcommon.unreadable import unreadable_message
from llmcommon.v1 import common_pb2, scheduler_pb2

if TYPE_CHECKING:
    from scheduler_svc.service import SchedulerService

log = logging.getLogger("scheduler")


class Rejected(Exception):
    """A submission the scheduler does not queue: the status its Submit call ends with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        details = bounded(details)
        super().__init__(details)
        self.code, self.details = code, details


class _Sink:
    """Stands in the relay's streams for one request of a session: its events join the
    session's next message."""

    __slots__ = ("session", "rid")

    def __init__(self, session: Session, rid: str) -> None:
        self.session, self.rid = session, rid

    def put_nowait(self, event: scheduler_pb2.TokenEvent) -> None:
        self.session.add(self.rid, event)


class Session:
    def __init__(self, service: SchedulerService) -> None:
        self.service = service
        self.pending: list[scheduler_pb2.RequestEvent] = []
        self.ready = asyncio.Event()
        self.sinks: dict[str, _Sink] = {}  # its requests in flight
        self.reading = True  # until the gateway closes its side
        self.unreadable = ""  # why a message from the gateway could not be read: the session ends

    def add(self, rid: str, event: scheduler_pb2.TokenEvent) -> None:
        self.pending.append(scheduler_pb2.RequestEvent(request_id=rid, event=event))
        if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._forget(rid)
        self.ready.set()

    def submit(self, request: scheduler_pb2.SubmitRequest) -> None:
        rid = request.request_id
        out = scheduler_pb2.RequestEvent(request_id=rid)
        if not rid:
            out.code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
            out.details = "a submission on a session needs a request_id"
        else:
            try:
                rid, queued = self.service.accept(request)
            except Rejected as rejected:
                out.code, out.details = rejected.code.value[0], rejected.details
            else:
                if queued:
                    out.accepted = True
                    self.sinks[rid] = self.service.streams[rid] = _Sink(self, rid)
                else:  # it had ended; only the news was lost
                    out.event.finish_reason = common_pb2.FINISH_REASON_STOP
        self.pending.append(out)  # before any of its events: nothing awaited since accept
        self.ready.set()

    def cancel(self, rid: str) -> None:
        if rid in self.sinks:
            self._forget(rid)
            self.service.drop(rid)

    def _forget(self, rid: str) -> None:
        sink = self.sinks.pop(rid, None)
        if sink is not None and self.service.streams.get(rid) is sink:
            del self.service.streams[rid]

    async def read(self, requests) -> None:
        try:
            async for request in requests:
                if request.HasField("submit"):
                    self.submit(request.submit)
                elif request.HasField("cancel"):
                    self.cancel(request.cancel.request_id)
        except Exception as err:  # noqa: BLE001 - an undecodable message: said, not swallowed
            self.unreadable = unreadable_message(err)
            log.error("a session's stream: %s; its requests are cancelled", self.unreadable)
        finally:
            self.reading = False
            self.ready.set()

    async def wake_at_stop(self, stopping: asyncio.Event) -> None:
        await stopping.wait()
        self.ready.set()

    def _over(self) -> bool:
        """No request left on it, and none can come: the gateway closed its side, or the
        scheduler is stopping (it refuses new ones; ending the stream lets it exit once the
        requests in flight are done, not at the end of its drain timeout)."""
        stopping = self.service.stopping
        if self.unreadable:
            return True
        return not self.sinks and (not self.reading or (stopping is not None and stopping.is_set()))

    async def next_message(self) -> scheduler_pb2.SessionEvents | None:
        """Everything that queued since the last message; None once the session is over."""
        while not self.pending:
            if self._over():
                return None
            self.ready.clear()
            await self.ready.wait()
        events, self.pending = self.pending, []
        return scheduler_pb2.SessionEvents(events=events)

    def close(self) -> None:
        for rid in list(self.sinks):
            self.cancel(rid)
