"""The Admin service through real processes (tiny model): the admin key refused or taken, a bad
value changing nothing, and live changes under 20 streaming greedy requests leaving every output
as an unchanged run gives it."""

from __future__ import annotations

import grpc
import pytest

from llmcommon.admin_auth import admin_metadata
from llmcommon.server import CHANNEL_OPTIONS
from llmcommon.v1 import scheduler_pb2, scheduler_pb2_grpc
from llmserve import client
from llmserve.cli import build_parser
from tests.stack_checks import wait_for
from tests.stacks import running_stack, tiny_settings
from tests.streams import Streams

KEY = "admin-secret-1"
START = {"policy": "reserve", "token_budget": "32"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    where = tmp_path_factory.mktemp("admin")
    (where / "admin.key").write_text(KEY + "\n")
    settings = tiny_settings(
        kv_capacity=512,
        block_size=16,
        token_budget=32,
        policy="reserve",
        admin_key_file=str(where / "admin.key"),
        max_queued_requests=64,
    )
    with running_stack(settings, where) as s:
        yield s


@pytest.fixture
def admin(stack):
    with client.Client(stack.settings.gateway, admin_key=KEY, timeout=30) as c:
        yield c
        c.set_settings(START)  # each test starts from the stack's flags


def admin_code(target: str, metadata=()) -> grpc.StatusCode:
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = scheduler_pb2_grpc.AdminStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetSettings(scheduler_pb2.GetSettingsRequest(), metadata=metadata, timeout=10)
    return err.value.code()


@pytest.mark.parametrize("where", ["gateway", "scheduler"])
def test_without_the_admin_key_unauthenticated_with_a_wrong_one_permission_denied(
    stack, where
) -> None:
    target = getattr(stack.settings, where)
    assert admin_code(target) is grpc.StatusCode.UNAUTHENTICATED
    assert admin_code(target, admin_metadata("wrong")) is grpc.StatusCode.PERMISSION_DENIED


def test_the_generation_api_stays_open_while_the_admin_one_is_not(stack, admin) -> None:
    with client.Client(stack.settings.gateway) as anyone:
        assert anyone.generate("Hello", max_tokens=2, temperature=0.0).text is not None
        assert anyone.status(explain=True)["explanation_withheld"]
    assert admin.get_settings()["policy"] == "reserve"


def test_status_explain_with_a_wrong_admin_key_is_permission_denied(stack) -> None:
    """Not "withheld: ask with --admin-key-file" to an operator who did send a key: through
    the gateway and from the scheduler itself."""
    with client.Client(stack.settings.gateway, admin_key="wrong") as wrong:
        with pytest.raises(grpc.RpcError) as err:
            wrong.status(explain=True)
        assert wrong.status()["running"] >= 0  # status without the explanation stays open
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "wrong admin key" in err.value.details()
    with grpc.insecure_channel(stack.settings.scheduler, options=CHANNEL_OPTIONS) as channel:
        status = scheduler_pb2_grpc.SchedulerStub(channel).Status
        request = scheduler_pb2.StatusRequest(explain=True)
        with pytest.raises(grpc.RpcError) as err:
            status(request, metadata=admin_metadata("wrong"), timeout=10)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert status(request, timeout=10).explanation_withheld  # no key: withheld


def test_a_bad_value_is_invalid_argument_naming_it_and_nothing_changes(admin) -> None:
    before = admin.get_settings()
    with pytest.raises(grpc.RpcError) as err:
        admin.set_settings({"policy": "paged", "token_budget": "0"})
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "token_budget" in err.value.details()
    assert admin.get_settings() == before


def test_a_setting_sent_twice_over_grpc_is_refused_and_nothing_changes(stack, admin) -> None:
    before = admin.get_settings()
    changes = [("token_budget", "64"), ("policy", "paged"), ("token_budget", "128")]
    request = scheduler_pb2.SetSettingsRequest(
        changes=[{"name": n, "value": v} for n, v in changes]
    )
    with grpc.insecure_channel(stack.settings.gateway, options=CHANNEL_OPTIONS) as channel:
        with pytest.raises(grpc.RpcError) as err:
            scheduler_pb2_grpc.AdminStub(channel).SetSettings(
                request, metadata=admin_metadata(KEY), timeout=10
            )
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "token_budget: given twice" in err.value.details()
    assert admin.get_settings() == before


def test_the_cli_sets_gets_and_explains(stack, admin, tmp_path, capsys) -> None:
    (tmp_path / "key").write_text(KEY)
    flags = ["--target", stack.settings.gateway, "--admin-key-file", str(tmp_path / "key")]

    def run(*argv: str) -> str:
        args = build_parser().parse_args([argv[0], *flags, *argv[1:]])
        assert args.func(args) == 0
        return capsys.readouterr().out

    assert run("set", "max_running=3", "chunked-prefill=off") == (
        "max_running: 32 -> 3\nchunked_prefill: true -> false\n"
    )
    assert "max_running=3\n" in run("get")
    assert "explain: nothing waits" in run("status", "--explain")


def greedy_requests() -> list:
    return [
        client.make_request(
            prompt=f"Request {i}: " + "count " * (i % 7), max_tokens=40, temperature=0.0
        )
        for i in range(20)
    ]


def outputs(stack, change: dict | None = None) -> list[list[int]]:
    streams = Streams(stack.settings.gateway, greedy_requests())
    if change is not None:
        wait_for(lambda: any(len(o.tokens) >= 2 for o in streams.outcomes), 60, "tokens")
        with client.Client(stack.settings.gateway, admin_key=KEY, timeout=30) as c:
            assert set(c.set_settings(change)) == set(change)
    done = streams.join(180)
    assert all(o.code is None and o.final is not None for o in done), [o.details for o in done]
    return [o.tokens for o in done]


def test_live_changes_under_20_streaming_greedy_requests_leave_their_outputs_identical(
    stack, admin
) -> None:
    unchanged = outputs(stack)
    assert outputs(stack, {"policy": "paged", "token_budget": "12"}) == unchanged
    assert admin.get_settings()["policy"] == "paged"
