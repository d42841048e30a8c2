"""A worker's answers are checked, never trusted (the internal-services sweep): a step answered
with too few or too many tokens, or logprobs that do not match them, fails that step's requests
as a failed forward does, and the scheduler carries on (it had exited 70 on a `zip()` error,
every request of every worker lost); a worker that describes a pool no request can use (a
block size of 0 had stopped the scheduler at the first Submit) stays out, named."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from llmcommon.sampling import SamplingParams
from llmcommon.v1 import common_pb2, worker_pb2
from scheduler_svc.config import WorkerSpec
from scheduler_svc.sequence import Finish, Sequence
from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.worker_client import BadWorker, WorkerClient, info_problem
from scheduler_svc.worker_loop import WorkerLoop
from tests.inproc import InProcessClient

SPEC = WorkerSpec("w0", 64, 4, 256)


def loop_with(*seqs: Sequence) -> tuple[SchedulerService, WorkerLoop]:
    settings = SchedulerSettings()
    client = InProcessClient(SPEC)
    client.info.vocab_size = 1000
    service = SchedulerService(settings, [client])
    service.workers.join(client)
    for seq in seqs:
        service.core.add(seq)
    return service, WorkerLoop(service.core, settings, service, 0, client)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ({"tokens": [7, 7]}, "2 tokens for 1 samples"),
        ({"tokens": [1000]}, "token id 1000 is outside the worker's vocabulary of 1000 tokens"),
        ({"tokens": []}, "0 tokens for 1 samples"),
        ({"tokens": [7], "logprobs": []}, None),  # logprobs not sent: the tokens stand
        (
            {"tokens": [7], "logprobs": [common_pb2.TokenLogprobs()] * 2},
            "2 logprobs for 1 sampled tokens",
        ),
    ],
    ids=["extra", "outside the vocabulary", "none", "no logprobs", "logprobs extra"],
)
def test_a_malformed_answer_fails_its_step_and_the_loop_goes_on(answer, why, caplog) -> None:
    a = Sequence("a", [3, 4, 5], 3)
    a.sampling = SamplingParams(logprobs=0)
    service, loop = loop_with(a)
    step = service.core.schedule(0)
    assert step.num_sampled == 1
    result = worker_pb2.StepResult(forward_seconds=0.01, **answer)
    loop.complete(step, result, time.perf_counter())  # it had raised ValueError (zip)
    if why is None:
        assert a.output_ids == [7] and a.finish is None
        return
    assert a.finish is Finish.ERROR and why in caplog.text
    c = Sequence("c", [3, 4], 2)  # the scheduler serves on
    service.core.add(c)
    for _ in range(2):
        step = service.core.schedule(0)
        assert a not in step.sampled_seqs()
        loop.complete(step, worker_pb2.StepResult(tokens=[9]), time.perf_counter())
    assert c.finish is Finish.LENGTH and c.output_ids == [9, 9]
    service.core.schedule(0)
    assert not service.core.workers[0].running and not service.core.seqs


def info(**fields) -> worker_pb2.WorkerInfo:
    base = dict(
        name="w",
        block_size=16,
        num_blocks=64,
        capacity_positions=1024,
        max_context=512,
        vocab_size=100,
    )
    return worker_pb2.WorkerInfo(**(base | fields))


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"block_size": 0, "capacity_positions": 0}, "block_size 0"),
        ({"num_blocks": 0, "capacity_positions": 0}, "num_blocks 0"),
        ({"max_context": 0}, "max_context 0"),
        ({"vocab_size": 0}, "vocab_size 0"),
        ({"capacity_positions": 5}, "capacity_positions 5, not num_blocks 64 x block_size 16"),
        (
            {"num_blocks": 2**32 - 1, "block_size": 1, "capacity_positions": 2**32 - 1},
            "num_blocks 4294967295 (at most 33554432",
        ),
    ],
)
def test_a_description_no_request_can_use_is_named(fields, problem) -> None:
    assert problem in info_problem(info(**fields))
    assert info_problem(info()) == ""


def test_describe_refuses_such_a_worker_as_an_rpc_error_naming_it() -> None:
    class Stub:
        async def Describe(self, request, **_):
            return info(block_size=0, capacity_positions=0)

    async def run() -> None:
        client = WorkerClient("127.0.0.1:1")
        client.stub = Stub()
        with pytest.raises(grpc.aio.AioRpcError) as err:  # handled where "no answer" is
            await client.describe()
        assert isinstance(err.value, BadWorker) and client.info is None
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "the worker at 127.0.0.1:1 describes block_size 0" in err.value.details()
        await client.close()

    asyncio.run(run())


def test_a_submit_whose_client_leaves_while_it_is_accepted_is_dropped() -> None:
    """The client cancels while the scheduler sends its acceptance (the internal-services
    sweep: 30 of 300 Submits cancelled within 4 ms ran on to max_tokens, nobody listening)."""
    from llmcommon.v1 import scheduler_pb2

    class Leaving:
        async def send_initial_metadata(self, metadata):
            raise asyncio.CancelledError  # what grpc raises into a handler whose call ended

        async def abort(self, code, details):  # pragma: no cover - not refused
            raise AssertionError(details)

    service, _ = loop_with()
    request = scheduler_pb2.SubmitRequest(
        request_id="gone", prompt_token_ids=[3, 4, 5], sampling=common_pb2.SamplingParams()
    )
    request.sampling.max_tokens = 50

    async def run() -> None:
        stream = service.Submit(request, Leaving())
        with pytest.raises(asyncio.CancelledError):
            await stream.__anext__()

    asyncio.run(run())
    assert "gone" not in service.streams
    service.core.schedule(0)  # the abort takes effect at the next step
    assert not service.core.seqs and not service.core.workers[0].running
