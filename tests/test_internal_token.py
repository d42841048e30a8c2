"""The internal token between gateway, scheduler and workers, through real processes: with one
configured, a call to the scheduler or a worker without it (or with a near miss) is
UNAUTHENTICATED while the stack serves through the gateway; probes stay open; a worker or a
gateway with the wrong token cannot take part; a token file that is empty or unreadable stops a
service at start."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llmcommon.auth import INTERNAL_REFUSAL, INTERNAL_TOKEN_HEADER, INTERNAL_TOKEN_VAR
from llmcommon.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from llmserve import client
from tests.stack_checks import is_idle, wait_for
from tests.stacks import free_port, running_stack, tiny_settings

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]

TOKEN = "llmserve-" + secrets.token_hex(16)
NEAR_MISS = TOKEN[:-1] + ("0" if TOKEN[-1] != "0" else "1")  # differs in the last byte only
WITHOUT_THE_TOKEN = {"no token": (), "a near miss": ((INTERNAL_TOKEN_HEADER, NEAR_MISS),)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("internal-token")
    (root / "token").write_text(TOKEN + "\n")
    settings = tiny_settings(internal_token_file=str(root / "token"))
    with running_stack(settings, root / "logs") as s:
        yield s


def generate(stack) -> int:
    request = client.make_request(prompt="hi", max_tokens=3, temperature=0.0)
    done = list(client.stream(stack.settings.gateway, request, timeout=30))
    return done[-1].final.usage.completion_tokens


def refused(call) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED, err.value.details()
    return err.value.details()


def worker_names(stack) -> list[str]:
    return [w.name for w in client.status(stack.settings.scheduler, token=TOKEN).workers]


def test_the_stack_serves_through_the_gateway_with_the_token_configured(stack) -> None:
    assert generate(stack) == 3
    assert worker_names(stack) == ["worker0"]


def test_a_client_that_leaves_mid_stream_frees_its_kv_with_the_token_configured(stack) -> None:
    """The gateway's calls to the scheduler pass through the token interceptor: cancelling one
    still reaches the scheduler."""

    def status():
        return client.status(stack.settings.scheduler, token=TOKEN)

    generated = status().generated_tokens
    request = client.make_request(prompt="hi", max_tokens=400, temperature=0.0, ignore_eos=True)
    stream = client.stream(stack.settings.gateway, request, timeout=60)
    next(stream)
    stream.close()  # the client leaves after its first message
    wait_for(lambda: is_idle(status()), 30, "the request's KV freed")
    assert status().generated_tokens - generated < 400  # stopped early, not run to the end


def test_scheduler_calls_without_the_token_are_unauthenticated(stack) -> None:
    admitted = client.status(stack.settings.scheduler, token=TOKEN).admitted
    submit = scheduler_pb2.SubmitRequest(
        request_id="intruder",
        prompt_token_ids=[1, 2, 3],
        sampling=common_pb2.SamplingParams(max_tokens=2),
    )
    with grpc.insecure_channel(stack.settings.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for metadata in WITHOUT_THE_TOKEN.values():
            calls = [
                lambda m=metadata: stub.Status(scheduler_pb2.StatusRequest(), metadata=m),
                lambda m=metadata: list(stub.Submit(submit, metadata=m, timeout=10)),
                lambda m=metadata: stub.Cancel(scheduler_pb2.CancelRequest(), metadata=m),
                lambda m=metadata: stub.Register(
                    scheduler_pb2.RegisterRequest(address="127.0.0.1:1"), metadata=m
                ),
            ]
            for call in calls:
                assert refused(call) == INTERNAL_REFUSAL
    assert client.status(stack.settings.scheduler, token=TOKEN).admitted == admitted


def test_worker_calls_without_the_token_are_unauthenticated(stack) -> None:
    with grpc.insecure_channel(stack.settings.worker_address(0)) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for metadata in WITHOUT_THE_TOKEN.values():
            refused(lambda m=metadata: stub.Describe(worker_pb2.DescribeRequest(), metadata=m))
            refused(lambda m=metadata: list(stub.Steps(iter(()), metadata=m, timeout=10)))
        own = stub.Describe(worker_pb2.DescribeRequest(), metadata=[(INTERNAL_TOKEN_HEADER, TOKEN)])
        assert own.name == "worker0"
    assert generate(stack) == 3  # the scheduler's own step stream was not disturbed


def test_health_and_reflection_stay_open_for_probes(stack) -> None:
    scheduler, worker = stack.settings.scheduler, stack.settings.worker_address(0)
    for target in (scheduler, worker):
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, target
    with grpc.insecure_channel(scheduler) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([ask]), timeout=10))
        names = {s.name for s in reply.list_services_response.service}
    assert "llmserve.v1.Scheduler" in names


def test_a_worker_with_the_wrong_token_cannot_join_one_with_the_right_token_can(
    stack, tmp_path
) -> None:
    (tmp_path / "wrong").write_text(NEAR_MISS)
    wrong = stack.join_worker(1, free_port(), "--internal-token-file", str(tmp_path / "wrong"))
    told = f"refused: {INTERNAL_REFUSAL}"
    wait_for(lambda: told in stack.log(wrong).read_text(), 20, "worker1 told it is refused")
    stack.join_worker(2, free_port())  # the stack's own token file
    wait_for(lambda: "worker2" in worker_names(stack), 20, "worker2 joined")
    assert sorted(worker_names(stack)) == ["worker0", "worker2"]


def test_a_gateway_with_the_wrong_token_exits_at_start_saying_why(stack, tmp_path) -> None:
    (tmp_path / "wrong").write_text(NEAR_MISS)
    command = [sys.executable, "-m", "gateway", "--port", str(free_port())]
    command += ["--scheduler", stack.settings.scheduler]
    command += ["--internal-token-file", str(tmp_path / "wrong")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"the scheduler refused this gateway: {INTERNAL_REFUSAL}" in done.stderr


@pytest.mark.parametrize(
    "module, setting, says",
    [
        ("gateway", "empty file", "is empty"),
        ("scheduler_svc", "empty file", "is empty"),
        ("worker_svc", "empty file", "is empty"),
        ("scheduler_svc", "missing file", "cannot read the internal token file"),
        ("gateway", "a token with a space", "must be printable ASCII without spaces"),
        ("worker_svc", "blank variable", "is empty"),
    ],
)
def test_a_configured_token_that_is_empty_or_unreadable_stops_the_service_at_start(
    module, setting, says, tmp_path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != INTERNAL_TOKEN_VAR}
    command = [sys.executable, "-m", module, "--port", str(free_port())]
    if setting == "blank variable":
        env[INTERNAL_TOKEN_VAR] = "  "
    else:
        contents = {"empty file": "\n", "a token with a space": "two words\n"}
        if setting in contents:
            (tmp_path / "token").write_text(contents[setting])
        command += ["--internal-token-file", str(tmp_path / "token")]
    if module == "worker_svc":
        command += ["--model", "tiny"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert says in done.stderr


def test_a_cells_gateway_exits_at_start_naming_a_cell_that_refuses_its_token(
    stack, tmp_path
) -> None:
    """The stack's scheduler accepts the gateway's token, a second cell has another one: the
    gateway exits naming that cell, whatever its place in --cells. (Unless it came first, the
    gateway served on the others and only logged the cell as "down".)"""
    (tmp_path / "other").write_text(NEAR_MISS)
    rogue = f"127.0.0.1:{free_port()}"
    cell = subprocess.Popen(
        [sys.executable, "-m", "scheduler_svc", "--port", rogue.rpartition(":")[2],
         "--workers", "", "--internal-token-file", str(tmp_path / "other")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(lambda: refused_by(rogue), 60, "the second cell answers", period=0.2)
        command = [sys.executable, "-m", "gateway", "--port", str(free_port())]
        command += ["--cells", f"{stack.settings.scheduler},{rogue}"]
        command += ["--internal-token-file", stack.settings.internal_token_file]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        cell.terminate()
        cell.wait(30)
    assert done.returncode != 0
    assert f"a cell refused this gateway: cell {rogue}: {INTERNAL_REFUSAL}" in done.stderr


def refused_by(scheduler: str) -> bool:
    try:
        client.status(scheduler, token=TOKEN)
    except grpc.RpcError as err:
        return err.code() is grpc.StatusCode.UNAUTHENTICATED
    return False
