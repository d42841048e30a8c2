"""The Admin service on the gateway: each call, its admin key checked here first, is passed on
to the scheduler with the key and the caller's address, so that one address serves a client
(`llmserve set --target GATEWAY`) and the scheduler's log names who asked. The scheduler checks
the key again and owns the settings."""

from __future__ import annotations

import grpc

from llmcommon.admin_auth import ADMIN_KEY_HEADER, FORWARDED_FOR, admin_key_of
from llmcommon.v1 import scheduler_pb2_grpc

TIMEOUT_S = 30.0  # an explanation plans the core a few dozen times


class GatewayAdmin(scheduler_pb2_grpc.AdminServicer):
    def __init__(self, stub: scheduler_pb2_grpc.AdminStub) -> None:
        self.stub = stub

    async def GetSettings(self, request, context):
        return await forward(self.stub.GetSettings, request, context)

    async def SetSettings(self, request, context):
        return await forward(self.stub.SetSettings, request, context)

    async def Explain(self, request, context):
        return await forward(self.stub.Explain, request, context)


def forwarded_metadata(context) -> tuple[tuple[str, str], ...]:
    """The admin key the caller sent and the caller's address, for the scheduler."""
    key = admin_key_of(context.invocation_metadata())
    return ((ADMIN_KEY_HEADER, key), (FORWARDED_FOR, context.peer()))


async def forward(call, request, context):
    remaining = context.time_remaining()
    timeout = min(remaining, TIMEOUT_S) if remaining is not None else TIMEOUT_S
    try:
        return await call(request, metadata=forwarded_metadata(context), timeout=timeout)
    except grpc.aio.AioRpcError as err:  # the scheduler's answer, as it gave it
        await context.abort(err.code(), err.details() or "")
