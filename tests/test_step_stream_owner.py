"""One scheduler drives a worker at a time: while a scheduler's step stream lives, a second one
is refused (FAILED_PRECONDITION, saying so) instead of silently taking the worker over; once the
first stream is gone (its scheduler was kill -9'd: at once; hung: after the keepalive) a new
scheduler takes over.

A real worker process (the simulated model); the first scheduler is a child process holding a
step stream that it has seen answered."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import pytest

from llmcommon.server import KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS, wait_healthy
from llmcommon.v1 import worker_pb2, worker_pb2_grpc
from tests.stacks import free_port

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]

TAKEOVER_BOUND_S = 15.0  # generous: a dead peer's socket is closed by its kernel at once

HOLDER = """
import sys, threading, time
import grpc
from llmcommon.v1 import worker_pb2, worker_pb2_grpc
steps = iter([worker_pb2.Step(step=1)])
gate = threading.Event()
def requests():
    yield next(steps)
    gate.wait()  # the stream stays open, sending nothing more, until this process dies
channel = grpc.insecure_channel(sys.argv[1])
results = worker_pb2_grpc.WorkerStub(channel).Steps(requests())
print("answered", next(results).step, flush=True)
time.sleep(600)
"""


def one_step(target: str, timeout: float = 10.0) -> worker_pb2.StepResult:
    """Open a step stream, send one empty step, return its answer (or raise the RpcError)."""
    with grpc.insecure_channel(target) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        return next(iter(stub.Steps(iter([worker_pb2.Step(step=7)]), timeout=timeout)))


@pytest.fixture
def worker(tmp_path):
    port = free_port()
    log = (tmp_path / "worker.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker_svc", "--model", "sim", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        asyncio.run(wait_healthy(f"127.0.0.1:{port}", 60))
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
        log.close()


def test_a_second_step_stream_is_refused_while_the_first_lives(worker) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, worker], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().split() == ["answered", "1"]
        with pytest.raises(grpc.RpcError) as refused:
            one_step(worker)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "another scheduler's step stream" in refused.value.details()
        assert holder.poll() is None  # the first stream was not disturbed
    finally:
        holder.kill()
        holder.wait()


def test_a_scheduler_killed_with_sigkill_is_replaced_at_once(worker) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, worker], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().split() == ["answered", "1"]
    holder.kill()  # kill -9: the worker learns only from the closed connection
    holder.wait()
    killed = time.monotonic()
    while True:
        try:
            result = one_step(worker)
            break
        except grpc.RpcError as err:
            assert err.code() is grpc.StatusCode.FAILED_PRECONDITION, err.details()
            assert time.monotonic() - killed < TAKEOVER_BOUND_S, "no takeover after SIGKILL"
            time.sleep(0.05)
    assert result.step == 7 and not result.error
    print(f"\ntakeover {time.monotonic() - killed:.2f} s after the first scheduler's SIGKILL")


def test_a_stream_that_ended_leaves_the_worker_free_for_the_next(worker) -> None:
    assert one_step(worker).step == 7
    assert one_step(worker).step == 7  # the first call's stream ended when it was closed


def test_a_hung_scheduler_loses_the_worker_to_the_keepalive(worker) -> None:
    """A scheduler stopped with SIGSTOP (or cut off) keeps its connection open but answers no
    HTTP/2 ping: the worker drops it after the keepalive's time and timeout, and a replacement
    takes over."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, worker], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().split() == ["answered", "1"]
        holder.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        bound = (KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS) / 1e3 + TAKEOVER_BOUND_S
        while True:
            try:
                result = one_step(worker)
                break
            except grpc.RpcError as err:
                assert err.code() is grpc.StatusCode.FAILED_PRECONDITION, err.details()
                assert time.monotonic() - stopped < bound, "the hung stream was never dropped"
                time.sleep(0.5)
        assert result.step == 7 and not result.error
        print(f"\ntakeover {time.monotonic() - stopped:.1f} s after the first scheduler's SIGSTOP")
    finally:
        holder.kill()
        holder.wait()
