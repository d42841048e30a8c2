"""The Admin service on the gateway: each call, its admin key checked here first, is passed on
to the scheduler with the key and the caller's address, so that one address serves a client
(`llmserve set --target GATEWAY`) and the scheduler's log names who asked. The scheduler checks
the key again and owns the settings. The gateway's own admin call, ReloadKeys (its API keys
read again), it answers itself, behind the same key."""

from __future__ import annotations

from dataclasses import replace

import grpc

from gateway.api_keys import KeysFileError
from gateway.key_table import KeyTable
from gateway.routing import Router
from gateway.routing.settings import LIVE, live_values, with_changes
from llmcommon.admin_auth import (
    ADMIN_KEY_HEADER,
    FORWARDED_FOR,
    AdminKeyInterceptor,
    admin_key_of,
)
from llmcommon.errors import bounded
from llmcommon.flags import field_name, given_twice
from llmcommon.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

TIMEOUT_S = 30.0  # an explanation plans the core a few dozen times
DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # a cell not answering


class GatewayAdmin(scheduler_pb2_grpc.AdminServicer):
    """With several cells (`router` given): the router's live settings (router, router_*) are
    the gateway's own, set here; the others go to every cell's scheduler that answers (the
    first's reply; a cell that is down is passed over, and `get` and `explain` ask the next)."""

    def __init__(
        self,
        stub: scheduler_pb2_grpc.AdminStub,
        router: Router | None = None,
        others: list[scheduler_pb2_grpc.AdminStub] | None = None,
    ) -> None:
        self.stub, self.router, self.others = stub, router, others or []

    async def GetSettings(self, request, context):
        reply = await self._any_cell("GetSettings", request, context)
        if self.router is not None:
            reply.settings.extend(_settings(live_values(self.router.settings)))
        return reply

    async def SetSettings(self, request, context):
        if self.router is None:
            return await forward(self.stub.SetSettings, request, context)
        twice = given_twice(c.name for c in request.changes)
        if twice is not None:  # as the cells refuse theirs (scheduler_svc/live_settings.py)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(f"{twice}: given twice"))
        ours = {field_name(c.name): c.value for c in request.changes if field_name(c.name) in LIVE}
        try:
            routing = with_changes(self.router.settings, ours)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(str(err)))
        rest = scheduler_pb2.SetSettingsRequest(
            changes=[c for c in request.changes if field_name(c.name) not in LIVE]
        )
        if rest.changes:
            reply = await self._every_cell(rest, context)
        else:
            reply = scheduler_pb2.SetSettingsReply()
            now = await self._any_cell("GetSettings", scheduler_pb2.GetSettingsRequest(), context)
            reply.settings.extend(now.settings)
        before = live_values(self.router.settings)
        self.router.configure(replace(routing, block_size=self.router.settings.block_size))
        after = live_values(self.router.settings)
        reply.settings.extend(_settings(after))
        for name in ours:
            if before[name] != after[name]:
                reply.changed.add(name=name, old_value=before[name], new_value=after[name])
        return reply

    async def Explain(self, request, context):
        if self.router is None:
            return await forward(self.stub.Explain, request, context)
        return await self._any_cell("Explain", request, context)

    async def _any_cell(self, method: str, request, context):
        """With cells: the first cell's answer, or the next one's while a cell is down."""
        stubs = [self.stub, *self.others]
        for i, stub in enumerate(stubs):
            try:
                return await ask(getattr(stub, method), request, context)
            except grpc.aio.AioRpcError as err:
                if err.code() not in DOWN or i == len(stubs) - 1:
                    await context.abort(err.code(), err.details() or "")

    async def _every_cell(self, request, context) -> scheduler_pb2.SetSettingsReply:
        """With cells: the changes sent to every cell that answers (the first one's reply); a
        cell that is down is passed over (it keeps its own settings when it comes back: set
        them again), a refusal ends it; UNAVAILABLE when no cell answers."""
        reply, down = None, []
        for stub in [self.stub, *self.others]:
            try:
                answer = await ask(stub.SetSettings, request, context)
            except grpc.aio.AioRpcError as err:
                if err.code() not in DOWN:
                    await context.abort(err.code(), with_router_names(err.details() or ""))
                down.append(err.details() or err.code().name)
                continue
            reply = reply or answer
        if reply is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"no cell answers: {down[0]}")
        return reply


UNKNOWN_NAME = "not a live setting (one of "  # the cells' refusal of a name (live_settings.py)


def with_router_names(details: str) -> str:
    """A cell's refusal of a name it does not know, its list of live settings completed with
    the router's (the gateway's own): the list had read as if they could not be changed."""
    return details.replace(UNKNOWN_NAME, UNKNOWN_NAME + ", ".join(LIVE) + ", ", 1)


def _settings(values: dict[str, str]) -> list[scheduler_pb2.Setting]:
    return [scheduler_pb2.Setting(name=k, value=v) for k, v in values.items()]


def forwarded_metadata(context) -> tuple[tuple[str, str], ...]:
    """The admin key the caller sent and the caller's address, for the scheduler."""
    key = admin_key_of(context.invocation_metadata())
    return ((ADMIN_KEY_HEADER, key), (FORWARDED_FOR, context.peer()))


async def ask(call, request, context):
    """The scheduler's answer to the call, with the caller's admin key; AioRpcError as is."""
    remaining = context.time_remaining()
    timeout = min(remaining, TIMEOUT_S) if remaining is not None else TIMEOUT_S
    return await call(request, metadata=forwarded_metadata(context), timeout=timeout)


async def forward(call, request, context):
    try:
        return await ask(call, request, context)
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
