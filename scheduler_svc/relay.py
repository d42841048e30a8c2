"""Hands the core's events to the request streams, merged per request."""

from __future__ import annotations

import asyncio
import zlib

from llmcommon.v1 import common_pb2, scheduler_pb2
from scheduler_svc.output import Event, StepLogprobs, StepTokens
from scheduler_svc.sequence import Finish

FINISH_TO_PROTO = {
    Finish.STOP: common_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    Finish.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    Finish.ERROR: common_pb2.FINISH_REASON_ERROR,
}
SLICES = 10  # an interval is handed over in this many slices of the requests


class EventRelay:
    """With `interval` 0, every dispatch is handed over at once. Otherwise each request's events
    wait up to `interval` seconds (several steps' tokens travel as one message), and the
    requests are handed over in slices (by a hash of their id) spread over the interval, so a
    few hundred streams never hold the event loop in one long burst, which would leave the
    workers' step loops waiting. Each request's events keep their order (a finish never
    overtakes a token)."""

    def __init__(
        self, streams: dict[str, asyncio.Queue[scheduler_pb2.TokenEvent]], interval: float
    ) -> None:
        self.streams = streams
        self.interval = interval
        self.pending: dict[str, scheduler_pb2.TokenEvent] = {}
        self.slices: list[list[str]] = [[] for _ in range(SLICES)]
        self.next_slice = 0
        self.handle: asyncio.TimerHandle | None = None

    def dispatch(self, events: list, now: bool = False) -> None:
        for ev in events:
            if type(ev) is tuple:  # a token: (request id, token)
                self._merged(ev[0]).token_ids.append(ev[1])
            elif type(ev) is StepTokens:  # a decode step's tokens
                for rid, token in ev:
                    self._merged(rid).token_ids.append(token)
            elif type(ev) is StepLogprobs:  # after the tokens they belong to
                for rid, logprobs in ev.items:
                    self._merged(rid).logprobs.append(logprobs)
            else:
                self._merge(ev)
        if now or self.interval <= 0:
            self.flush()
        elif self.handle is None and self.pending:
            self.handle = asyncio.get_running_loop().call_later(self.interval / SLICES, self.tick)

    def _merged(self, rid: str) -> scheduler_pb2.TokenEvent:
        out = self.pending.get(rid)
        if out is None:
            out = self.pending[rid] = scheduler_pb2.TokenEvent()
            self.slices[zlib.crc32(rid.encode()) % SLICES].append(rid)
        return out

    def _merge(self, ev: Event) -> None:
        out = self._merged(ev.request_id)
        if ev.admitted:
            out.admitted, out.queue_time_s = True, ev.queue_time
            out.cached_tokens = ev.cached_tokens
        if ev.token_id is not None:
            out.token_ids.append(ev.token_id)
        if ev.finish is not None:
            out.finish_reason = FINISH_TO_PROTO[ev.finish]
            out.error, out.preemptions = ev.error, ev.preemptions

    def tick(self) -> None:
        rids, self.slices[self.next_slice] = self.slices[self.next_slice], []
        self.next_slice = (self.next_slice + 1) % SLICES
        self._hand_over(rids)
        self.handle = None
        if self.pending:
            self.handle = asyncio.get_running_loop().call_later(self.interval / SLICES, self.tick)

    def flush(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        rids = [rid for s in self.slices for rid in s]
        self.slices = [[] for _ in range(SLICES)]
        self._hand_over(rids)

    def _hand_over(self, rids: list[str]) -> None:
        for rid in rids:
            out = self.pending.pop(rid, None)
            queue = self.streams.get(rid)
            if out is not None and queue is not None:
                queue.put_nowait(out)


async def next_message(queue: asyncio.Queue[scheduler_pb2.TokenEvent]) -> scheduler_pb2.TokenEvent:
    """A request stream's next message: the first event waiting, with every event queued
    behind it merged in (tokens and logprobs appended in order, the admission and the finish
    kept). A stream that fell behind the steps catches up in one message, not one per step;
    one that keeps up sends each step's news at once."""
    event = await queue.get()
    while not queue.empty():
        event.MergeFrom(queue.get_nowait())
    return event
