"""A hung scheduler is bounded by the gateway (gateway/scheduler_watch.py): NOT_SERVING and new
requests refused after --scheduler-timeout without a health answer; the requests it holds end
with UNAVAILABLE after --resubmit-timeout; SERVING again once it answers."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.core import GenerateInput
from gateway.generation_errors import GenerationError
from gateway.scheduler_watch import SilenceBound, Verdict
from llmcommon.protocol import ACCEPTED_KEY
from llmcommon.sampling import SamplingParams
from llmcommon.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.gateway_harness import gateway_core
from tests.stack_checks import generate, greedy_request, stop_cleanly, wait_for
from tests.stacks import running_stack
from tests.streams import Streams
from tests.test_faults import BOUND, held_settings

SCHEDULER_TIMEOUT, RESUBMIT_TIMEOUT = 2.0, 6.0


def test_silence_turns_hung_then_given_up_and_an_answer_ends_it() -> None:
    now = [0.0]
    bound = SilenceBound(hung_after=5.0, give_up_after=30.0, clock=lambda: now[0])
    seen = []
    for t, silent in [(0, True), (4, True), (5, True), (29, True), (30, True), (31, False)]:
        now[0] = t
        seen.append(bound.observe(silent))
    A, H, G = Verdict.ANSWERS, Verdict.HUNG, Verdict.GIVEN_UP
    assert seen == [A, A, H, H, G, A]
    now[0] = 40.0
    assert bound.observe(True) is A  # silence counts again from its own start


def test_silence_counts_from_when_the_unanswered_check_was_sent() -> None:
    """A check sent at 1 s that times out at 3 s: the silence began at 1 s, so the second
    unanswered check, ending at 6 s, finds it hung (5 s). Counted from 3 s, it took till 9 s."""
    now = [3.0]
    bound = SilenceBound(hung_after=5.0, give_up_after=30.0, clock=lambda: now[0])
    assert bound.observe(True, asked=1.0) is Verdict.ANSWERS
    now[0] = 6.0
    assert bound.observe(True, asked=4.0) is Verdict.HUNG
    assert bound.problem() == "the scheduler has not answered for 5 s (hung?); retry"


class HungScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Accepts a request, then answers nothing more (as a stopped process)."""

    async def Submit(self, request, context):
        await context.send_initial_metadata(((ACCEPTED_KEY, "1"),))
        yield scheduler_pb2.TokenEvent(admitted=True)
        await asyncio.Event().wait()

    async def Session(self, request_iterator, context):
        async for message in request_iterator:
            rid = message.submit.request_id
            admitted = scheduler_pb2.TokenEvent(admitted=True)
            yield scheduler_pb2.SessionEvents(
                events=[scheduler_pb2.RequestEvent(request_id=rid, accepted=True, event=admitted)]
            )
            await asyncio.Event().wait()


@pytest.mark.parametrize("streams", ["session", "request"])
def test_giving_up_on_a_hung_scheduler_ends_held_requests_and_refuses_new_ones(streams) -> None:
    async def scenario() -> tuple[GenerationError, GenerationError, bool]:
        async with gateway_core(HungScheduler(), streams) as core:
            job = GenerateInput(prompt="Hello", sampling=SamplingParams(max_tokens=8))

            async def consume() -> None:
                async for _ in core.generate(job, lambda: None):  # no deadline
                    pass

            held = asyncio.create_task(consume())
            async with asyncio.timeout(30):  # bounds a failure only: the fake accepts at once
                while not core.held:
                    await asyncio.sleep(0.01)
            core.give_up_on_scheduler("the scheduler has not answered for 30 s (hung?)")
            with pytest.raises(GenerationError) as ended:
                await asyncio.wait_for(held, 10)
            with pytest.raises(GenerationError) as refused:
                await consume()
            return ended.value, refused.value, not core.held

    ended, refused, released = asyncio.run(scenario())
    assert ended.code is grpc.StatusCode.UNAVAILABLE and "has not answered" in ended.message
    assert refused.code is grpc.StatusCode.UNAVAILABLE and "has not answered" in refused.message
    assert released


def gateway_health(target: str) -> int | None:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        except grpc.RpcError:
            return None
        return reply.status


@pytest.mark.slow
@pytest.mark.usefixtures("hang_guard")
def test_a_stopped_scheduler_turns_the_gateway_not_serving_and_bounds_held_streams(
    tmp_path, monkeypatch
) -> None:
    """SIGSTOP the scheduler under a stream without a deadline: the gateway's gRPC health turns
    NOT_SERVING (it stayed SERVING), new requests are refused, the held stream ends with
    UNAVAILABLE (it waited as long as the scheduler hung); after SIGCONT it serves again."""
    monkeypatch.setenv("LLMSERVE_GATEWAY_SCHEDULER_TIMEOUT", str(SCHEDULER_TIMEOUT))
    monkeypatch.setenv("LLMSERVE_GATEWAY_RESUBMIT_TIMEOUT", str(RESUBMIT_TIMEOUT))
    settings = held_settings(kv_capacity=2048, token_budget=64)  # the stream outlasts the stop
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    with running_stack(settings, tmp_path) as stack:
        gw = settings.gateway
        streams = Streams(gw, [greedy_request(0, 1500)], timeout=None)
        wait_for(lambda: streams.all_have(3), 60, "the stream has tokens")
        scheduler = stack.procs["scheduler"]
        scheduler.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_for(
                lambda: gateway_health(gw) == not_serving, SCHEDULER_TIMEOUT + BOUND, "NOT_SERVING"
            )
            with pytest.raises(grpc.RpcError) as err:
                generate(gw, greedy_request(1, 4), timeout=BOUND)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "has not answered" in err.value.details()
            [outcome] = streams.join(RESUBMIT_TIMEOUT + BOUND)
            ended = outcome.ended_at - stopped
        finally:
            scheduler.send_signal(signal.SIGCONT)
        assert outcome.code is grpc.StatusCode.UNAVAILABLE, (outcome.code, outcome.details)
        assert "has not answered" in outcome.details
        print(f"\nscheduler SIGSTOPped: held stream ended UNAVAILABLE after {ended:.1f} s")
        wait_for(lambda: gateway_health(gw) == serving, BOUND, "SERVING again")
        assert len(generate(gw, greedy_request(2, 8))[0]) == 8
        stop_cleanly(stack)
