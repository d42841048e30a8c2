"""The relay of token events to request streams: with a stream interval, events wait and travel
merged per request, spread over the interval in slices; they never reorder."""

from __future__ import annotations

import asyncio

from llmcommon.v1 import common_pb2
from scheduler_svc.output import Event, StepTokens
from scheduler_svc.relay import SLICES, EventRelay
from scheduler_svc.sequence import Finish
from tests.sim import seq


def counted_ticks(relay: EventRelay) -> list[float]:
    """The loop times at which the relay's timer ticks (each tick hands over one slice)."""
    ticks: list[float] = []
    tick = relay.tick

    def counted() -> None:
        ticks.append(asyncio.get_running_loop().time())
        tick()

    relay.tick = counted  # the relay arms its timer with self.tick
    return ticks


def drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_without_an_interval_events_are_handed_over_at_once() -> None:
    async def scenario() -> list:
        streams = {"a": asyncio.Queue()}
        EventRelay(streams, 0.0).dispatch([Event("a", token_id=5), ("a", 6)])
        return drain(streams["a"])

    got = asyncio.run(scenario())
    assert len(got) == 1 and list(got[0].token_ids) == [5, 6]


def test_delayed_events_arrive_within_the_interval_merged_per_request() -> None:
    """Within the interval: at one of the first SLICES ticks, each interval / SLICES after the
    one before (counted, not timed: a loaded host may run every tick late)."""

    async def scenario() -> tuple[list, list, list[float]]:
        streams = {"a": asyncio.Queue()}
        relay = EventRelay(streams, 0.02)
        ticks = counted_ticks(relay)
        relay.dispatch([Event("a", token_id=5), ("a", 6)])
        before = drain(streams["a"])
        after = [await asyncio.wait_for(streams["a"].get(), 30)]
        return before, after + drain(streams["a"]), ticks

    before, after, ticks = asyncio.run(scenario())
    assert before == []
    assert len(after) == 1 and list(after[0].token_ids) == [5, 6]
    assert 1 <= len(ticks) <= SLICES


def test_an_immediate_dispatch_first_hands_over_the_delayed_events() -> None:
    """A step's tokens are delayed; the request then finishes and is flushed at once: the stream
    sees the tokens before the finish, and each only once."""

    async def scenario() -> list:
        streams = {"a": asyncio.Queue()}
        relay = EventRelay(streams, 0.5)
        ticks = counted_ticks(relay)
        relay.dispatch([("a", 7)])
        relay.dispatch([Event("a", finish=Finish.LENGTH)], now=True)
        got = drain(streams["a"])
        # The cancelled timer was due 0.05 s after the dispatch: the loop runs timers by their
        # deadlines, so this later one returns after it would have ticked, on any host.
        await asyncio.sleep(0.6)
        return got + drain(streams["a"]), ticks

    events, ticks = asyncio.run(scenario())
    assert ticks == []  # the cancelled timer never ticked
    assert [t for e in events for t in e.token_ids] == [7]
    assert events[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_many_requests_are_handed_over_in_slices_not_one_burst() -> None:
    """200 streams with a 50 ms interval: no tick hands over more than a few slices' worth, and
    every stream gets its tokens within the interval, in order."""

    async def scenario() -> tuple[list[int], dict[str, list[int]]]:
        ids = [f"r{i}" for i in range(200)]
        streams = {rid: asyncio.Queue() for rid in ids}
        relay = EventRelay(streams, 0.05)
        seqs = [seq(rid, 1, 1) for rid in ids]
        relay.dispatch([StepTokens(seqs, [1] * 200)])
        relay.dispatch([StepTokens(seqs, [2] * 200)])
        sizes = []
        for _ in range(SLICES + 2):
            await asyncio.sleep(0.05 / SLICES)
            sizes.append(sum(q.qsize() for q in streams.values()))
        got = {rid: [t for e in drain(q) for t in e.token_ids] for rid, q in streams.items()}
        return sizes, got

    sizes, got = asyncio.run(scenario())
    handed = [b - a for a, b in zip([0, *sizes], sizes, strict=False)]
    assert max(handed) <= 200 * 3 // SLICES  # hash slices: roughly a tenth each
    assert all(tokens == [1, 2] for tokens in got.values())
