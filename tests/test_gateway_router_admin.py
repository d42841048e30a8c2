"""`llmserve set` through a gateway with several cells: the router's settings (router,
router_*) are the gateway's own, set at once and all or nothing; the others reach every cell."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.admin import GatewayAdmin
from gateway.routing import RoutePolicy, Router, RouterSettings
from llmcommon.v1 import scheduler_pb2


class FakeAdmin:
    """A cell's Admin stub: records what it was sent, answers one setting."""

    def __init__(self) -> None:
        self.sent: list[scheduler_pb2.SetSettingsRequest] = []

    async def GetSettings(self, request, **_):
        return scheduler_pb2.Settings(settings=[{"name": "token_budget", "value": "256"}])

    async def SetSettings(self, request, **_):
        self.sent.append(request)
        return scheduler_pb2.SetSettingsReply(
            settings=[{"name": "token_budget", "value": request.changes[0].value}]
        )


class Context:
    def time_remaining(self):
        return None

    def invocation_metadata(self):
        return ()

    def peer(self):
        return "ipv4:127.0.0.1:1"

    async def abort(self, code, details):
        raise grpc.RpcError(code, details)


def set_settings(admin: GatewayAdmin, **changes: str):
    request = scheduler_pb2.SetSettingsRequest(
        changes=[{"name": k, "value": v} for k, v in changes.items()]
    )
    return asyncio.run(admin.SetSettings(request, Context()))


def test_router_settings_change_in_the_gateway_and_the_rest_reach_every_cell():
    first, second = FakeAdmin(), FakeAdmin()
    router = Router(["a", "b"])
    admin = GatewayAdmin(first, router, [second])
    reply = set_settings(admin, router="round-robin", token_budget="512")
    assert router.settings.policy is RoutePolicy.ROUND_ROBIN
    assert [(c.name, c.old_value, c.new_value) for c in reply.changed] == [
        ("router", "cache-aware", "round-robin")
    ]
    for cell in (first, second):
        assert [(c.name, c.value) for c in cell.sent[0].changes] == [("token_budget", "512")]
    names = {s.name: s.value for s in asyncio.run(admin.GetSettings(None, Context())).settings}
    assert names["router"] == "round-robin" and names["token_budget"] == "256"


def test_a_bad_router_setting_changes_nothing_anywhere():
    first = FakeAdmin()
    router = Router(["a", "b"])
    with pytest.raises(grpc.RpcError):
        set_settings(GatewayAdmin(first, router), router="fastest", token_budget="512")
    assert router.settings.policy is RoutePolicy.CACHE_AWARE and first.sent == []


def test_a_router_setting_given_twice_changes_nothing_anywhere():
    first = FakeAdmin()
    router = Router(["a", "b"])
    request = scheduler_pb2.SetSettingsRequest(
        changes=[
            {"name": "router", "value": "round-robin"},
            {"name": "token_budget", "value": "512"},
            {"name": "router", "value": "least-loaded"},
        ]
    )
    with pytest.raises(grpc.RpcError, match="router: given twice"):
        asyncio.run(GatewayAdmin(first, router).SetSettings(request, Context()))
    assert router.settings.policy is RoutePolicy.CACHE_AWARE and first.sent == []


class DownAdmin:
    """A cell whose scheduler is down: every call UNAVAILABLE."""

    def __init__(self) -> None:
        self.sent: list = []

    async def _down(self, request, **_):
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down"
        )

    GetSettings = SetSettings = Explain = _down


def test_a_cell_that_is_down_is_passed_over_and_the_others_are_set():
    """The first cell down: `set` reaches the others (it failed outright), `get` asks the next."""
    first, second = DownAdmin(), FakeAdmin()
    router = Router(["a", "b"])
    admin = GatewayAdmin(first, router, [second])
    reply = set_settings(admin, token_budget="512")
    assert [(c.name, c.value) for c in second.sent[0].changes] == [("token_budget", "512")]
    assert {s.name: s.value for s in reply.settings}["token_budget"] == "512"
    names = {s.name: s.value for s in asyncio.run(admin.GetSettings(None, Context())).settings}
    assert names["token_budget"] == "256" and "router" in names


def test_with_every_cell_down_set_is_unavailable():
    router = Router(["a", "b"])
    with pytest.raises(grpc.RpcError) as err:
        set_settings(GatewayAdmin(DownAdmin(), router, [DownAdmin()]), token_budget="512")
    assert err.value.args[0] is grpc.StatusCode.UNAVAILABLE


def test_a_router_setting_takes_the_dash_spelling_as_the_cells_settings_do():
    first = FakeAdmin()
    router = Router(["a", "b"])
    request = scheduler_pb2.SetSettingsRequest(
        changes=[{"name": "router-load-weight", "value": "2"}]
    )
    reply = asyncio.run(GatewayAdmin(first, router).SetSettings(request, Context()))
    assert router.settings.load_weight == 2.0 and first.sent == []
    assert [(c.name, c.new_value) for c in reply.changed] == [("router_load_weight", "2.0")]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("router_load_weight", "nan"),
        ("router_load_weight", "inf"),
        ("router_recent_half_life_s", "1e400"),
        ("router_balance_abs_threshold", "inf"),
        ("router_cache_threshold", "nan"),
        ("router_index_blocks", "99999999999999"),
    ],
)
def test_a_router_value_not_finite_or_past_its_bound_is_refused_changing_nothing(name, value):
    """(All were taken: load_weight nan shown as 1.0 -> nan; inf made cache-aware route by
    load alone from then on: the cells sweep.)"""
    first = FakeAdmin()
    router = Router(["a", "b"])
    with pytest.raises(grpc.RpcError) as refused:
        set_settings(GatewayAdmin(first, router), **{name: value, "token_budget": "512"})
    code, details = refused.value.args
    assert code is grpc.StatusCode.INVALID_ARGUMENT and name in details, details
    assert router.settings == RouterSettings() and first.sent == []


class RefusingAdmin(FakeAdmin):
    """A cell that does not know a name, refusing it as a scheduler does."""

    async def SetSettings(self, request, **_):
        details = "colour: not a live setting (one of token_budget, policy)"
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), details
        )


def test_an_unknown_name_is_refused_listing_the_routers_settings_too():
    router = Router(["a", "b"])
    with pytest.raises(grpc.RpcError) as refused:
        set_settings(GatewayAdmin(RefusingAdmin(), router), colour="blue")
    code, details = refused.value.args
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("colour: not a live setting (one of router, router_cache_threshold")
    assert details.endswith("router_recent_half_life_s, token_budget, policy)")
