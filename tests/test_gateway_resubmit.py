"""The gateway's resubmission when its scheduler dies mid-stream, against a fake scheduler
in-process (a real gRPC server on loopback, scripted answers): a request whose end is already
known is ended, not resubmitted; one that may go on is resubmitted with every token it streamed.
Each test runs with the gateway's requests on its session stream and on a Submit call each."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.core import Delta, Finish, GenerateInput
from gateway.tokenizer_files import load_tokenizer
from llmcommon.protocol import ACCEPTED_KEY
from llmcommon.sampling import SamplingParams
from llmcommon.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.gateway_harness import gateway_core

LOST = "lost"  # the scheduler dies after the tokens: no finish reaches the gateway
STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH
EOS = 2  # the packaged model's end of sequence


@pytest.fixture(scope="module")
def tokenizer_files():
    return load_tokenizer("")


@pytest.fixture(params=["session", "request"])
def tokenizer(request, tokenizer_files):
    """The tokenizer, and the way the gateway's requests travel (--scheduler-streams)."""
    return tokenizer_files, request.param


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Submit number k accepts the request, streams scripts[k]'s tokens, then ends as told."""

    def __init__(self, scripts: list[tuple[list[int], object]]) -> None:
        self.scripts = scripts
        self.submits: list[scheduler_pb2.SubmitRequest] = []

    async def Submit(self, request, context):
        self.submits.append(request)
        tokens, end = self.scripts[len(self.submits) - 1]
        await context.send_initial_metadata(((ACCEPTED_KEY, "1"),))
        yield scheduler_pb2.TokenEvent(admitted=True)
        for token in tokens:
            yield scheduler_pb2.TokenEvent(token_ids=[token])
        if end == LOST:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        yield scheduler_pb2.TokenEvent(finish_reason=end)

    async def Session(self, request_iterator, context):
        """The same scripts on a session: a LOST end breaks the whole stream."""
        async for message in request_iterator:
            request = message.submit
            self.submits.append(request)
            tokens, end = self.scripts[len(self.submits) - 1]
            news = scheduler_pb2.RequestEvent
            rid = request.request_id
            admitted = scheduler_pb2.TokenEvent(admitted=True)
            yield scheduler_pb2.SessionEvents(
                events=[news(request_id=rid, accepted=True), news(request_id=rid, event=admitted)]
            )
            for token in tokens:
                event = scheduler_pb2.TokenEvent(token_ids=[token])
                yield scheduler_pb2.SessionEvents(events=[news(request_id=rid, event=event)])
            if end == LOST:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            event = scheduler_pb2.TokenEvent(finish_reason=end)
            yield scheduler_pb2.SessionEvents(events=[news(request_id=rid, event=event)])


def run(tokenizer, scripts, job: GenerateInput) -> tuple[list[int], Finish, FakeScheduler]:
    tokenizer, streams = tokenizer

    async def scenario():
        fake = FakeScheduler(scripts)
        async with gateway_core(fake, streams, tokenizer) as core:
            events = [e async for e in core.generate(job, lambda: 30.0)]
        tokens = [t for e in events if isinstance(e, Delta) for t in e.token_ids]
        assert isinstance(events[-1], Finish)
        return tokens, events[-1], fake

    return asyncio.run(scenario())


def test_a_request_whose_tokens_were_all_streamed_is_ended_not_resubmitted(tokenizer) -> None:
    job = GenerateInput(prompt="Hello there", sampling=SamplingParams(max_tokens=4))
    tokens, finish, fake = run(tokenizer, [([101, 102, 103, 104], LOST)], job)
    assert tokens == [101, 102, 103, 104]
    assert finish.reason == LENGTH and finish.usage.completion_tokens == 4
    assert len(fake.submits) == 1


def test_a_request_that_streamed_its_stop_token_id_is_ended_not_resubmitted(tokenizer) -> None:
    """Its last token is one of its stop_token_ids: it has ended, only the news was lost."""
    job = GenerateInput(
        prompt="Hello there", sampling=SamplingParams(max_tokens=10, stop_token_ids=(777,))
    )
    tokens, finish, fake = run(tokenizer, [([101, 102, 777], LOST)], job)
    assert tokens == [101, 102, 777]
    assert finish.reason == STOP
    assert len(fake.submits) == 1


def test_an_ignore_eos_request_that_streamed_eos_is_resubmitted_and_goes_on(tokenizer) -> None:
    """EOS ends nothing under ignore_eos: the request is resubmitted with every token streamed
    (EOS included) and the client gets the rest, no gap, no duplicate."""
    job = GenerateInput(
        prompt="Hello there", sampling=SamplingParams(max_tokens=5, ignore_eos=True)
    )
    scripts = [([101, EOS], LOST), ([103, 104, 105], LENGTH)]
    tokens, finish, fake = run(tokenizer, scripts, job)
    assert tokens == [101, EOS, 103, 104, 105]
    assert finish.reason == LENGTH and finish.usage.completion_tokens == 5
    assert [list(s.resume_token_ids) for s in fake.submits] == [[], [101, EOS]]
    assert fake.submits[1].sampling.ignore_eos
