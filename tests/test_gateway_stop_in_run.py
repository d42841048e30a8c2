"""A stop string inside an event of several tokens (a decode run's, --decode-steps): the output
ends at the token that completes the stop; the tokens after it in the same event are neither
sent to the client nor counted in its usage. Against a fake scheduler in-process (a real gRPC
server on loopback) that answers with the tokens in groups, on a session and on Submit calls."""

from __future__ import annotations

import asyncio

import pytest

from gateway.core import Delta, Finish, GenerateInput
from gateway.tokenizer_files import load_tokenizer
from llmcommon.protocol import ACCEPTED_KEY
from llmcommon.sampling import SamplingParams
from llmcommon.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.gateway_harness import gateway_core

TEXT = " one two three four five six seven eight nine ten"
STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("")


class GroupedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Every request is admitted and gets `groups` of tokens, one event each, then LENGTH."""

    def __init__(self, groups: list[list[int]]) -> None:
        self.groups = groups

    def _events(self):
        yield scheduler_pb2.TokenEvent(admitted=True)
        for group in self.groups:
            yield scheduler_pb2.TokenEvent(token_ids=group)
        yield scheduler_pb2.TokenEvent(finish_reason=LENGTH)

    async def Submit(self, request, context):
        await context.send_initial_metadata(((ACCEPTED_KEY, "1"),))
        for event in self._events():
            yield event

    async def Session(self, request_iterator, context):
        news = scheduler_pb2.RequestEvent
        async for message in request_iterator:
            rid = message.submit.request_id
            yield scheduler_pb2.SessionEvents(events=[news(request_id=rid, accepted=True)])
            for event in self._events():
                yield scheduler_pb2.SessionEvents(events=[news(request_id=rid, event=event)])


def run(tokenizer, streams: str, groups: list[list[int]], job: GenerateInput):
    async def scenario():
        async with gateway_core(GroupedScheduler(groups), streams, tokenizer) as core:
            return [e async for e in core.generate(job, lambda: 30.0)]

    events = asyncio.run(scenario())
    deltas = [e for e in events if isinstance(e, Delta)]
    assert isinstance(events[-1], Finish)
    return deltas, events[-1]


def completing(tokenizer, ids: list[int], stop: str) -> int:
    """How many of `ids` it takes for their text to hold `stop`."""
    return next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))


@pytest.mark.parametrize("streams", ["session", "request"])
@pytest.mark.parametrize("stop", [" three", "four f", "ten"])
def test_the_output_ends_at_the_token_that_completes_the_stop(tokenizer, streams, stop) -> None:
    ids = tokenizer.encode(TEXT)
    groups = [ids[:1]] + [ids[i : i + 8] for i in range(1, len(ids), 8)]  # a prompt, runs of 8
    k = completing(tokenizer, ids, stop)
    job = GenerateInput(prompt="Count", sampling=SamplingParams(max_tokens=len(ids), stop=(stop,)))
    deltas, finish = run(tokenizer, streams, groups, job)
    sent = [t for d in deltas for t in d.token_ids]
    assert sent == ids[:k]
    assert finish.reason == STOP and finish.usage.completion_tokens == k
    assert "".join(d.text for d in deltas) == TEXT[: TEXT.index(stop)]


def test_without_a_stop_every_token_of_every_group_counts(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    groups = [ids[:1]] + [ids[i : i + 8] for i in range(1, len(ids), 8)]
    job = GenerateInput(prompt="Count", sampling=SamplingParams(max_tokens=len(ids)))
    deltas, finish = run(tokenizer, "request", groups, job)
    assert [t for d in deltas for t in d.token_ids] == ids
    assert finish.reason == LENGTH and finish.usage.completion_tokens == len(ids)
    assert "".join(d.text for d in deltas) == TEXT
