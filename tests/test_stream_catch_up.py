"""A request stream that fell behind the steps sends what queued up as one message: the same
tokens, logprobs, admission and finish, in order; one that keeps up sends each step at once."""

from __future__ import annotations

import asyncio

from llmcommon.v1 import common_pb2
from scheduler_svc.output import Event, StepLogprobs
from scheduler_svc.relay import EventRelay, next_message
from scheduler_svc.sequence import Finish


def logprobs(token: int) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(logprob=-float(token))


def test_a_stream_behind_gets_every_queued_event_in_one_message_in_order() -> None:
    async def scenario():
        streams = {"a": asyncio.Queue()}
        relay = EventRelay(streams, 0.0)
        relay.dispatch([Event("a", admitted=True, queue_time=0.5, cached_tokens=16), ("a", 5)])
        relay.dispatch([("a", 6), StepLogprobs([("a", logprobs(6))])])
        relay.dispatch([Event("a", token_id=7, finish=Finish.LENGTH, preemptions=1)])
        message = await next_message(streams["a"])
        return message, streams["a"].empty()

    message, drained = asyncio.run(scenario())
    assert drained
    assert list(message.token_ids) == [5, 6, 7]
    assert [lp.logprob for lp in message.logprobs] == [-6.0]
    assert message.admitted and message.queue_time_s == 0.5 and message.cached_tokens == 16
    assert message.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert message.preemptions == 1


def test_a_stream_that_keeps_up_gets_one_message_per_step() -> None:
    async def scenario():
        streams = {"a": asyncio.Queue()}
        relay = EventRelay(streams, 0.0)
        got = []
        for token in (5, 6, 7):
            relay.dispatch([("a", token)])
            got.append(list((await next_message(streams["a"])).token_ids))
        return got

    assert asyncio.run(scenario()) == [[5], [6], [7]]


def test_the_next_message_waits_for_an_event() -> None:
    async def scenario():
        streams = {"a": asyncio.Queue()}
        waiting = asyncio.ensure_future(next_message(streams["a"]))
        await asyncio.sleep(0)
        assert not waiting.done()
        EventRelay(streams, 0.0).dispatch([("a", 9)])
        return list((await asyncio.wait_for(waiting, 30)).token_ids)

    assert asyncio.run(scenario()) == [9]
