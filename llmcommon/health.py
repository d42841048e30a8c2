"""grpc.health.v1 Check and Watch for our servers, with Watch streams that end at shutdown.

grpcio's aio HealthServicer keeps a Watch stream open until the server's grace period runs out,
so one load balancer watching a server makes every graceful stop last the whole grace period,
even when no request is in flight. Here `close()` sets every service NOT_SERVING; each
Watch stream sends that status and then ends, so the stop waits only for real calls.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmcommon.errors import bounded

Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


async def check_health(channel: grpc.aio.Channel, service: str = "", timeout: float = 1.0):
    """The client side, for every caller (the scheduler watching its workers, start-up waits,
    container health checks): the serving status of `service` ("" = the whole server) on the
    server behind `channel`. Raises grpc.aio.AioRpcError when it does not answer."""
    request = health_pb2.HealthCheckRequest(service=service)
    reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout)
    return reply.status


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.statuses: dict[str, Status] = {"": NOT_SERVING}
        self.closing = False
        self._changed = asyncio.Event()  # replaced by a fresh one at every change

    async def Check(self, request, context):
        status = self.statuses.get(request.service)
        if status is None:
            why = bounded(f"unknown service {request.service!r}")
            await context.abort(grpc.StatusCode.NOT_FOUND, why)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        """Each change of the service's status (yielded, not written with context.write: so an
        undecodable request is INVALID_ARGUMENT here too, llmcommon/unreadable.py)."""
        last = None
        while True:
            changed = self._changed  # taken before reading, so no change is missed
            status = self.statuses.get(request.service, SERVICE_UNKNOWN)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if self.closing:
                return
            await changed.wait()

    async def set(self, service: str, status: Status) -> None:
        if self.closing:
            return
        self.statuses[service] = status
        self._notify()

    async def close(self) -> None:
        """Everything NOT_SERVING for good; Watch streams send it and end."""
        self.closing = True
        for service in self.statuses:
            self.statuses[service] = NOT_SERVING
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
