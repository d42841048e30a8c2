"""gRPC clients of the workers: Describe and health, and the step stream."""

from __future__ import annotations

import asyncio

import grpc

from llmcommon.auth import token_metadata
from llmcommon.health import SERVING, check_health
from llmcommon.server import CHANNEL_OPTIONS
from llmcommon.v1 import worker_pb2, worker_pb2_grpc
from scheduler_svc.config import WorkerSpec


class WorkerLost(Exception):
    """The worker's step stream broke, ended, or its answer did not come in time."""


class BadWorker(grpc.aio.AioRpcError):
    """A worker that answered Describe with a pool no request can use (a block size of 0 had
    stopped the scheduler at the first Submit): handled where a worker that does not answer
    is, and named as such (FAILED_PRECONDITION with the fault)."""

    def __init__(self, target: str, problem: str) -> None:
        details = f"the worker at {target} describes {problem}: it stays out"
        empty = grpc.aio.Metadata()
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, empty, empty, details)


MAX_BLOCKS = 1 << 25  # the scheduler keeps a table entry a block: 10 M took it a second


def info_problem(info: worker_pb2.WorkerInfo) -> str:
    """What makes a worker's description unusable ("" if nothing)."""
    for field in ("block_size", "num_blocks", "max_context", "vocab_size"):
        if getattr(info, field) < 1:
            return f"{field} {getattr(info, field)} (it must be at least 1)"
    if info.num_blocks > MAX_BLOCKS:  # up to 2^32 - 1 had frozen the scheduler while it joined
        return f"num_blocks {info.num_blocks} (at most {MAX_BLOCKS}: raise the block size)"
    if info.capacity_positions != info.num_blocks * info.block_size:
        return (
            f"capacity_positions {info.capacity_positions}, not num_blocks {info.num_blocks} x "
            f"block_size {info.block_size}"
        )
    return ""


Joined = tuple[str, worker_pb2.WorkerInfo, bool]  # a worker's address, description, and live


def join_problem(info: worker_pb2.WorkerInfo, joined: list[Joined]) -> str:
    """Why a worker described as `info` cannot join beside `joined` ("" if it can): it is the
    process of a live one reached at another address (its stream would be refused, a phantom
    worker in the meantime), it serves another model (the gateway, which tokenizes for one,
    refuses every request while the workers disagree), or it has another vocabulary than theirs
    (it had made every client's request look out of vocabulary)."""
    for target, other, live in joined:
        if live and info.instance and other.instance == info.instance:
            return f"the same instance as the worker at {target} (one process at two addresses)"
    models = {other.model for _, other, _ in joined}
    if models and info.model not in models:  # the gateway would refuse every request
        have = ", ".join(map(repr, sorted(models)))
        return f"model {info.model!r} where the stack's workers serve {have}"
    vocabs = {other.vocab_size for _, other, _ in joined}
    if not vocabs or info.vocab_size in vocabs:
        return ""
    have = ", ".join(map(str, sorted(vocabs)))
    return f"vocab_size {info.vocab_size} where the stack's workers have {have} (another model?)"


class WorkerClient:
    def __init__(self, target: str, static: bool = True, token: str = "") -> None:
        self.target = target
        self.static = static  # named in --workers (else it registered itself)
        # The internal token goes on each call here rather than through a channel interceptor:
        # an intercepted stream-stream call (Steps, the hot path) proxies every write through a
        # queue and a task, and raises InvalidStateError where a broken stream raised an RpcError.
        self.metadata = token_metadata(token)
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.info: worker_pb2.WorkerInfo | None = None
        self.last_forward = 0.0  # seconds of the last step's forward pass
        self.forward_seconds = self.idle_seconds = 0.0
        self.step_bytes = 0
        self.unreachable_since: float | None = None  # failed or gone since
        self.silent_since: float | None = None  # a live worker's health checks unanswered since

    async def serving(self, timeout: float = 1.0) -> bool | None:
        """The worker's health: True SERVING, False NOT_SERVING (stopping), None unreachable."""
        try:
            return await check_health(self.channel, timeout=timeout) == SERVING
        except grpc.aio.AioRpcError:
            return None

    async def describe(self, timeout: float = 5.0) -> worker_pb2.WorkerInfo:
        """The worker's description; BadWorker (an AioRpcError) if no request could use it."""
        info = await self.stub.Describe(
            worker_pb2.DescribeRequest(), timeout=timeout, metadata=self.metadata
        )
        problem = info_problem(info)
        if problem:
            raise BadWorker(self.target, problem)
        self.info = info
        return info

    def spec(self) -> WorkerSpec:
        assert self.info is not None
        return WorkerSpec(
            name=self.info.name or self.target,
            num_blocks=self.info.num_blocks,
            block_size=self.info.block_size,
            max_context=self.info.max_context,
        )

    def open(self) -> StepStream:
        return StepStream(self.stub.Steps(metadata=self.metadata))

    async def close(self) -> None:
        await self.channel.close()


class StepStream:
    """One scheduler's step stream to one worker: write steps, read their results in order."""

    def __init__(self, call) -> None:
        self.call = call
        self.reading: asyncio.Task | None = None  # the read of the next result, kept if late

    async def send(self, step: worker_pb2.Step) -> None:
        try:
            await self.call.write(step)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as err:
            raise WorkerLost(f"step stream broke: {err}") from err

    async def receive(self, timeout: float) -> worker_pb2.StepResult | None:
        """The next result, or None if it has not come within `timeout` seconds. The read goes
        on (a cancelled read would cancel the call): the caller judges whether the worker is
        late, by the scheduler's own running time, and asks again or gives up."""
        if self.reading is None:
            self.reading = asyncio.ensure_future(self.call.read())
        done, _ = await asyncio.wait((self.reading,), timeout=timeout)
        if not done:
            return None
        reading, self.reading = self.reading, None
        try:
            result = reading.result()
        except grpc.aio.AioRpcError as err:
            raise WorkerLost(f"{err.code().name}: {err.details()}") from err
        if result is grpc.aio.EOF:
            raise WorkerLost("the worker ended the step stream")
        return result

    def check(self) -> None:
        """An idle loop reads nothing: notice a stream the worker has ended (it left or died)."""
        if self.call.done():
            raise WorkerLost("the worker ended the step stream")

    def cancel(self) -> None:
        if self.reading is not None:
            self.reading.cancel()
        self.call.cancel()
