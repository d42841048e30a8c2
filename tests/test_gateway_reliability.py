"""The gateway under large and hostile requests, through real processes (the simulated model,
each step at least SIM_STEP_MS, so a long stream outlasts whatever the test does meanwhile on any
host): work that grows with a request is bounded before it starts and done off the event loop,
so other streams keep flowing; refused requests leave no memory behind; a gzip bomb is never
inflated; and client cancellations and passed deadlines are counted as `cancelled`."""

from __future__ import annotations

import bisect
import itertools
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmcommon.v1 import gateway_pb2, gateway_pb2_grpc
from llmserve import client
from tests.stack_checks import rss_kib, wait_for
from tests.stacks import free_run, running_stack, tiny_settings

pytestmark = pytest.mark.usefixtures("hang_guard")
# The longest pause allowed between two tokens of a running stream while huge requests are
# refused: it was 2 to 6 s when a 0.8 MB chat was rendered and tokenized on the event loop. A
# loaded host may stretch every gap: the bound grows with the longest gap of the same stream
# before the refusals (GAP_FACTOR times it), measured in the same run.
MAX_GAP_S, GAP_FACTOR = 1.0, 10.0
SIM_STEP_MS = 20.0  # a 1900-token stream lasts 38 s or more
LONG = client.make_request(prompt="Tell me", max_tokens=1900, ignore_eos=True)
MIB = 1024  # in KiB, as /proc reports memory


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings = tiny_settings(model="sim", sim_step_ms=SIM_STEP_MS, metrics_base_port=free_run(3))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LLMSERVE_WORKER_MAX_CONTEXT", "2048")  # the tiny model's: the same limits
        with running_stack(settings, tmp_path_factory.mktemp("reliability")) as s:
            yield s


@pytest.fixture(scope="module")
def stub(stack):
    options = [("grpc.max_send_message_length", -1)]  # the bomb is 64 MB before compression
    with grpc.insecure_channel(stack.settings.gateway, options=options) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def chat(messages: int) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest()
    request.chat.messages.extend(gateway_pb2.ChatMessage(role="user") for _ in range(messages))
    return request


def refusal(stub, request, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        stub.GenerateUnary(request, timeout=60, **kwargs)
    return err.value.code(), err.value.details()


@contextmanager
def stream_in_background(target: str):
    """A long greedy stream; yields the arrival times of its messages, until the block ends."""
    times: list[float] = []
    stop = threading.Event()

    def run() -> None:
        for _ in client.stream(target, LONG, timeout=120):
            times.append(time.monotonic())
            if stop.is_set():
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(times) >= 20, 30, "the stream's first tokens")
        yield times
    finally:
        stop.set()
        thread.join(30)


def longest_gap(times: list[float]) -> float:
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def test_huge_requests_are_refused_at_once_while_other_streams_keep_flowing(stack, stub) -> None:
    huge = [
        (chat(100_000), "the chat has 100000 messages; the limit is 2048"),  # 0.8 MB
        (gateway_pb2.GenerateRequest(prompt="a " * 499_000), "the prompt has 998000 characters"),
        (gateway_pb2.GenerateRequest(prompt="a " * 80_000), "prompt of 80001 tokens"),  # tokenized
    ]
    with stream_in_background(stack.settings.gateway) as times:
        started = time.monotonic()
        for request, message in huge:
            code, details = refusal(stub, request)
            assert code is grpc.StatusCode.INVALID_ARGUMENT and message in details, details
        took = time.monotonic() - started
        seen = len(times)  # the stream goes on: its next arrivals close the gap in progress
        wait_for(lambda: len(times) >= seen + 3, 30, "the stream's tokens after the refusals")
    k = bisect.bisect_right(times, started)  # the first arrival after the refusals began
    before, during = longest_gap(times[1:k]), longest_gap(times[k - 1 :])  # [0]: the prefill
    bound = max(MAX_GAP_S, GAP_FACTOR * before)
    print(f"\nrefused in {took:.2f} s; the stream's longest gap meanwhile: {during:.3f} s "
          f"(before: {before:.3f} s; bound {bound:.2f} s)")  # fmt: skip
    assert during < bound


def test_refused_large_requests_leave_the_gateway_memory_flat(stack, stub) -> None:
    pid = stack.procs["gateway"].pid
    large = [chat(100_000)] * 40 + [gateway_pb2.GenerateRequest(prompt="a " * 80_000)] * 16
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda r: refusal(stub, r), large[-8:]))  # the pool's threads warm up
        before = rss_kib(pid)
        codes = {code for code, _ in pool.map(lambda r: refusal(stub, r), large)}
    assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
    grown = rss_kib(pid) - before
    print(f"\n{len(large)} large refused requests: gateway RSS {before // MIB} MiB + {grown} KiB")
    assert grown < 32 * MIB


def test_a_gzip_bomb_is_refused_without_being_inflated(stack, stub) -> None:
    gzip = grpc.Compression.Gzip
    compressed = client.make_request(prompt="hello " * 200, max_tokens=3)
    assert len(stub.GenerateUnary(compressed, timeout=30, compression=gzip).token_ids) == 3
    pid = stack.procs["gateway"].pid
    peak = rss_kib(pid, "VmHWM")
    bomb = gateway_pb2.GenerateRequest(prompt="a" * (64 << 20))  # ~0.1 MB on the wire
    code, details = refusal(stub, bomb, compression=gzip)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert "inflates to more than 1048576 bytes" in details
    assert rss_kib(pid, "VmHWM") - peak < 16 * MIB  # inflating it whole took 64 MB


def finished(stack) -> dict[str, float]:
    url = f"http://127.0.0.1:{stack.settings.metrics_port(0)}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        sample.labels["finish_reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "llmserve_gateway_requests_finished_total"
    }


def test_cancelled_streams_and_passed_deadlines_count_as_cancelled(stack, stub) -> None:
    """A stream cancelled after 3 tokens, and one whose 0.5 s deadline passes: LONG lasts 38 s
    or more on the simulated model, so the deadline passes first on any host."""
    before = finished(stack)
    call = stub.Generate(LONG, timeout=60)
    for got, _ in enumerate(call):
        if got == 3:
            break
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(LONG, timeout=0.5))
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED

    def counted() -> dict[str, float]:
        now = finished(stack)
        return now if now["cancelled"] - before["cancelled"] == 2 else {}

    after = wait_for(counted, 10, "two requests counted as cancelled")
    assert after["none"] == before["none"]
