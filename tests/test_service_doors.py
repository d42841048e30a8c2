"""Each service converts and checks what arrives at its own door, once (the gateway its clients'
requests, the scheduler a Submit, a worker a step's new requests), and trusts it after: a bad
max_tokens sent straight to the scheduler's gRPC is refused with INVALID_ARGUMENT, and one sent
straight to a worker's fails that request alone; the gateway's rules on max_tokens (its default,
the rest of the context) hold min_tokens within what they resolve. Real gRPC servers on
loopback, in-process; the simulated model."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.core import GatewayCore, GenerateInput, GenerationError
from gateway.settings import GatewaySettings
from gateway.tokenizer_files import load_tokenizer
from llmcommon.sampling import SamplingParams
from llmcommon.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler_svc.config import WorkerSpec
from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import SchedulerSettings
from tests.inproc import InProcessClient
from tests.test_gateway_resubmit import LENGTH, FakeScheduler
from worker_svc.__main__ import make_runner
from worker_svc.service import WorkerService
from worker_svc.settings import WorkerSettings

BOUND = 30  # seconds: bounds a failure only
BAD_SUBMITS = {  # what is wrong -> the words of the refusal
    "max_tokens 0": (dict(max_tokens=0), [], "max_tokens is 0"),
    "max_tokens unset": (dict(), [], "max_tokens is not set"),
    "min_tokens beyond max_tokens": (dict(max_tokens=2, min_tokens=3), [], "min_tokens 3"),
    "resumed tokens": (dict(max_tokens=2), [7, 8], "resumed tokens leave nothing"),
}


async def served(add, servicer) -> tuple[grpc.aio.Server, grpc.aio.Channel]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def test_a_bad_max_tokens_sent_straight_to_the_scheduler_is_refused_and_a_good_one_runs():
    async def scenario():
        service = SchedulerService(
            SchedulerSettings(), [InProcessClient(WorkerSpec("w0", 64, 4, 256))]
        )
        service.start()
        server, channel = await served(scheduler_pb2_grpc.add_SchedulerServicer_to_server, service)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        refusals = {}
        try:
            for what, (sampling, resumed, _) in BAD_SUBMITS.items():
                request = scheduler_pb2.SubmitRequest(
                    prompt_token_ids=[5, 6],
                    resume_token_ids=resumed,
                    sampling=common_pb2.SamplingParams(temperature=0, **sampling),
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async with asyncio.timeout(BOUND):
                        _ = [event async for event in stub.Submit(request)]
                refusals[what] = err.value
            good = scheduler_pb2.SubmitRequest(
                prompt_token_ids=[5, 6],
                sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
            )
            async with asyncio.timeout(BOUND):
                events = [event async for event in stub.Submit(good)]
        finally:
            await channel.close()
            await server.stop(0)
            for task in [
                service.clock_task,
                service.watch_task,
                *(lp.task for lp in service.loops),
            ]:
                task.cancel()
        return refusals, events

    refusals, events = asyncio.run(scenario())
    for what, (_, _, words) in BAD_SUBMITS.items():
        assert refusals[what].code() is grpc.StatusCode.INVALID_ARGUMENT, what
        assert words in refusals[what].details(), (what, refusals[what].details())
    assert sum(len(e.token_ids) for e in events) == 3
    assert events[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def placed(step: worker_pb2.Step, handle: int, block: int, **sampling) -> None:
    """A new request in `step`: its settings, one block, a two-token prompt to sample after."""
    settings = common_pb2.SamplingParams(temperature=0, **sampling)
    step.added.add(handle=handle, request_id=f"r{handle}", sampling=settings)
    step.grants.add(handle=handle, blocks=[block])
    step.chunks.add(handle=handle, token_ids=[5, 6], start_position=0, sample=True)


def test_a_bad_max_tokens_sent_straight_to_a_worker_fails_that_request_alone() -> None:
    async def scenario():
        settings = WorkerSettings(model="sim")
        service = WorkerService(settings, make_runner(settings), "sim")
        server, channel = await served(worker_pb2_grpc.add_WorkerServicer_to_server, service)
        step = worker_pb2.Step(step=1)
        placed(step, 0, 0, max_tokens=4)
        placed(step, 1, 1, max_tokens=0)
        placed(step, 2, 2, max_tokens=2, min_tokens=3)
        try:
            stream = worker_pb2_grpc.WorkerStub(channel).Steps()
            await stream.write(step)
            async with asyncio.timeout(BOUND):
                result = await stream.read()
            await stream.done_writing()
        finally:
            await channel.close()
            await server.stop(0)
            service.executor.shutdown()
        return result

    result = asyncio.run(scenario())
    assert not result.error
    assert set(result.failed) == {1, 2}
    assert "max_tokens is 0" in result.failed[1]
    assert "min_tokens 3 is more than max_tokens 2" in result.failed[2]
    assert len(result.tokens) == 1  # request 0 ran


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("")


def generate(tokenizer, job: GenerateInput) -> tuple[list, FakeScheduler]:
    """The gateway's generation path against a scheduler that streams nothing and ends."""

    async def scenario():
        fake = FakeScheduler([([], LENGTH)])
        server, channel = await served(scheduler_pb2_grpc.add_SchedulerServicer_to_server, fake)
        try:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            core = GatewayCore(GatewaySettings(default_max_tokens=16), tokenizer, stub, 64)
            return [e async for e in core.generate(job, lambda: 30.0)], fake
        finally:
            await channel.close()
            await server.stop(0)

    return asyncio.run(scenario())


def refusal(tokenizer, job: GenerateInput) -> GenerationError:
    with pytest.raises(GenerationError) as err:
        generate(tokenizer, job)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    return err.value


def test_the_grpc_default_max_tokens_holds_min_tokens_within_it(tokenizer) -> None:
    err = refusal(tokenizer, GenerateInput(prompt="Hello", sampling=SamplingParams(min_tokens=17)))
    assert (err.param, err.message) == ("min_tokens", "min_tokens 17 is more than max_tokens 16")
    _, fake = generate(
        tokenizer, GenerateInput(prompt="Hello", sampling=SamplingParams(min_tokens=16))
    )
    assert fake.submits[0].sampling.max_tokens == 16


def test_the_rest_of_the_context_as_max_tokens_holds_min_tokens_within_it(tokenizer) -> None:
    """The HTTP API's rule (fit_context): max_tokens unset is what the prompt leaves of the
    context, resolved once the prompt is counted; min_tokens is checked against that."""
    prompt_tokens = len(tokenizer.encode("Hello", add_special_tokens=True))
    rest = 64 - prompt_tokens
    job = GenerateInput(prompt="Hello", sampling=SamplingParams(min_tokens=rest), fit_context=True)
    _, fake = generate(tokenizer, job)
    assert (fake.submits[0].sampling.max_tokens, fake.submits[0].sampling.min_tokens) == (
        rest,
        rest,
    )
    over = GenerateInput(
        prompt="Hello", sampling=SamplingParams(min_tokens=rest + 1), fit_context=True
    )
    err = refusal(tokenizer, over)
    assert err.param == "min_tokens" and f"more than max_tokens {rest}" in err.message


def test_max_tokens_beyond_the_context_is_a_context_overflow_whatever_min_tokens_says(
    tokenizer,
) -> None:
    sampling = SamplingParams(max_tokens=100, min_tokens=200)
    err = refusal(tokenizer, GenerateInput(prompt="Hello", sampling=sampling, fit_context=True))
    assert err.param == "max_tokens" and "maximum context length is 64 tokens" in err.message
