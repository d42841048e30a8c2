"""gRPC clients of the workers: Describe at start, Execute once per step."""

from __future__ import annotations

import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.server import CHANNEL_OPTIONS
from llmserve.v1 import worker_pb2, worker_pb2_grpc
from scheduler_svc.config import WorkerSpec
from scheduler_svc.plan import WorkerBatch


class WorkerClient:
    def __init__(self, target: str) -> None:
        self.target = target
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.info: worker_pb2.WorkerInfo | None = None
        self.last_forward = 0.0  # seconds of the last Execute's forward pass
        self.session = uuid.uuid4().hex[:12]  # this scheduler process
        self.restores = 0

    @property
    def epoch(self) -> str:
        """Changes with every scheduler process and every re-admission of this worker."""
        return f"{self.session}.{self.restores}"

    async def serving(self, timeout: float = 1.0) -> bool | None:
        """The worker's health: True SERVING, False NOT_SERVING (stopping), None unreachable."""
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return None
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def describe(self, timeout: float = 5.0) -> worker_pb2.WorkerInfo:
        self.info = await self.stub.Describe(worker_pb2.DescribeRequest(), timeout=timeout)
        return self.info

    def spec(self) -> WorkerSpec:
        assert self.info is not None
        return WorkerSpec(
            name=self.info.name or self.target,
            num_blocks=self.info.num_blocks,
            block_size=self.info.block_size,
            max_context=self.info.max_context,
        )

    async def execute(self, step: int, batch: WorkerBatch, timeout: float) -> dict[str, int]:
        request = worker_pb2.ExecuteRequest(step=step, released=batch.released, epoch=self.epoch)
        for work in batch.items:
            seq = work.seq
            request.items.append(
                worker_pb2.WorkItem(
                    request_id=seq.request_id,
                    token_ids=work.token_ids,
                    start_position=work.start,
                    block_table=work.block_table,
                    sample=work.sample,
                    sampling=seq.sampling,
                    sample_index=len(seq.output_ids),
                )
            )
        reply = await self.stub.Execute(request, timeout=timeout)
        self.last_forward = reply.forward_seconds
        return {r.request_id: r.token_id for r in reply.results if r.has_token}

    async def close(self) -> None:
        await self.channel.close()
