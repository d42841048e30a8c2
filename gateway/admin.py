"""The Admin service on the gateway: each call, its admin key checked here first, is passed on
to the scheduler with the key and the caller's address, so that one address serves a client
(`llmserve set --target GATEWAY`) and the scheduler's log names who asked. The scheduler checks
the key again and owns the settings. The gateway's own admin call, ReloadKeys (its API keys
read again), it answers itself, behind the same key."""

from __future__ import annotations

import grpc

from gateway.api_keys import KeysFileError
from gateway.key_table import KeyTable
from llmcommon.admin_auth import (
    ADMIN_KEY_HEADER,
    FORWARDED_FOR,
    AdminKeyInterceptor,
    admin_key_of,
)
from llmcommon.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2_grpc

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


GATEWAY_ADMIN_SERVICE = "llmserve.v1.GatewayAdmin"


class GatewayKeysAdmin(gateway_pb2_grpc.GatewayAdminServicer):
    """The gateway's own admin calls: its API keys read again (gateway/key_table.py)."""

    def __init__(self, keys: KeyTable) -> None:
        self.keys = keys

    async def ReloadKeys(self, request, context):
        try:
            keys = self.keys.reload()
        except KeysFileError as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"keys not reloaded: {err}")
        return gateway_pb2.ReloadKeysReply(
            keys=len(keys.entries), tenants=len(keys.tenants), summary=self.keys.summary()
        )


class GatewayAdminKeyInterceptor(AdminKeyInterceptor):
    """The admin key on the gateway's own admin calls, as on the Admin service."""

    services = frozenset({GATEWAY_ADMIN_SERVICE})
