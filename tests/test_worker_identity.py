"""One worker process is one worker, whatever address it is reached at: the scheduler knows
it by the instance id its description carries (random at the worker's start). Reached at a
second spelling (localhost:p beside 127.0.0.1:p, a name beside its IP), it is refused with the
address it is driven at, instead of joining as a phantom second worker whose step stream the
worker refuses (requests placed on it moved again; a registering worker churned every 2 s).

Real processes, the simulated model."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from llmcommon.server import CHANNEL_OPTIONS, wait_healthy
from llmcommon.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from llmserve import client
from llmserve.ports import free_port
from tests.stack_checks import wait_for
from tests.stacks import running_stack, tiny_settings

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings = tiny_settings(model="sim", sim_step_ms=5.0, kv_capacity=4096)
    with running_stack(settings, tmp_path_factory.mktemp("identity")) as s:
        yield s


def other_spelling(address: str) -> str:
    assert address.startswith("127.0.0.1:")
    return "localhost:" + address.split(":")[1]


def instance(target: str) -> str:
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        return stub.Describe(worker_pb2.DescribeRequest(), timeout=10).instance


def test_a_worker_describes_one_instance_at_every_address(stack) -> None:
    address = stack.settings.worker_address(0)
    first = instance(address)
    assert len(first) == 32 and instance(other_spelling(address)) == first


def test_a_worker_registered_at_another_spelling_is_refused_naming_its_address(stack) -> None:
    address = stack.settings.worker_address(0)
    with grpc.insecure_channel(stack.settings.scheduler, options=CHANNEL_OPTIONS) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(
                scheduler_pb2.RegisterRequest(address=other_spelling(address)), timeout=10
            )
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details() == (
        f"the worker at {other_spelling(address)} describes the same instance as the worker at "
        f"{address} (one process at two addresses): it stays out"
    )
    assert [w.address for w in client.status(stack.settings.scheduler).workers] == [address]
    with client.Client(stack.settings.gateway, timeout=60) as c:
        assert c.generate("hello", max_tokens=3, ignore_eos=True).usage["completion_tokens"] == 3


def test_a_scheduler_listing_one_worker_twice_stops_in_one_line(stack) -> None:
    address = stack.settings.worker_address(0)
    workers = f"{address},{other_spelling(address)}"
    command = [sys.executable, "-m", "scheduler_svc", "--port", str(free_port()),
               "--workers", workers]  # fmt: skip
    ended = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert ended.returncode != 0 and "Traceback" not in ended.stderr
    assert ended.stderr.strip().splitlines()[-1] == (
        f"worker {other_spelling(address)} describes the same instance as the worker at "
        f"{address} (one process at two addresses)"
    )


def test_a_listed_worker_back_under_another_spelling_is_not_restored_beside_it(tmp_path) -> None:
    """worker0 (listed in --workers as 127.0.0.1:p) is killed and started again registering as
    localhost:p: it joins under that address while its listed entry is down; when the listed
    entry answers again it is the same instance, and stays out. (It had been restored beside
    the registered one: a phantom whose stream the worker refused, "failed / is back" four
    times a second: the regression sweep.)"""
    settings = tiny_settings(model="sim", sim_step_ms=5.0, kv_capacity=4096)
    with running_stack(settings, tmp_path) as stack:
        address = settings.worker_address(0)
        stack.procs["worker0"].kill()
        stack.procs["worker0"].wait(10)
        sched = settings.scheduler
        wait_for(lambda: not client.status(sched).workers[0].healthy, 30, "worker0 failed")
        command = stack.worker_command(0, settings.worker_base_port, "--scheduler", sched,
                                       "--advertise", other_spelling(address))  # fmt: skip
        with open(tmp_path / "worker0b.log", "w") as log:
            again = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            says = f"describes the same instance as the worker at {other_spelling(address)}"
            wait_for(lambda: says in stack.log("scheduler").read_text(), 60, "the entry kept out")
            rows = client.status(sched).workers
            assert [(w.address, w.healthy) for w in rows] == [
                (address, False),
                (other_spelling(address), True),
            ]
            with client.Client(settings.gateway, timeout=60) as c:
                usage = c.generate("hello", max_tokens=3, ignore_eos=True).usage
            assert usage["completion_tokens"] == 3
            assert "is back" not in stack.log("scheduler").read_text()
        finally:
            again.terminate()
            again.wait(30)


def test_a_scheduler_listing_workers_of_two_models_stops_in_one_line(stack, tmp_path) -> None:
    """sim and tiny share a vocabulary, but the gateway tokenizes for one model and refuses
    every request while the workers name two: the scheduler stops at the start, naming both
    (it had served them side by side: the regression sweep)."""
    port = free_port()
    command = [sys.executable, "-m", "worker_svc", "--model", "tiny", "--dtype", "fp32",
               "--port", str(port), "--kv-capacity", "4096", "--threads", "1"]  # fmt: skip
    with open(tmp_path / "tiny_worker.log", "w") as log:
        tiny = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        asyncio.run(wait_healthy(f"127.0.0.1:{port}", 120))
        workers = f"{stack.settings.worker_address(0)},127.0.0.1:{port}"
        command = [sys.executable, "-m", "scheduler_svc", "--port", str(free_port()),
                   "--workers", workers]  # fmt: skip
        ended = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        tiny.terminate()
        tiny.wait(30)
    assert ended.returncode != 0 and "Traceback" not in ended.stderr
    assert ended.stderr.strip().splitlines()[-1] == (
        f"worker 127.0.0.1:{port} describes model 'tiny' where the stack's workers serve 'sim'"
    )
