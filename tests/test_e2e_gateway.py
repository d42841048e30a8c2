"""The public API through real processes (tiny model): bad input, streaming, stops, cancel,
queue limits, preemption and chunked prefill losing nothing."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from llmcommon.server import CHANNEL_OPTIONS
from llmcommon.v1 import gateway_pb2, gateway_pb2_grpc
from llmserve import client
from tests.stack_checks import wait_for
from tests.stacks import running_stack, tiny_settings
from tests.streams import Held

PROMPTS = ["Hello there", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "日本語 🙂"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings = tiny_settings(
        kv_capacity=1024, block_size=16, token_budget=64, max_queued_requests=64
    )
    with running_stack(settings, tmp_path_factory.mktemp("stack")) as s:
        yield s


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.settings.gateway, options=CHANNEL_OPTIONS) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def code_of(stub, request, unary: bool = False) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        if unary:
            stub.GenerateUnary(request, timeout=30)
        else:
            list(stub.Generate(request, timeout=30))
    return err.value.code(), err.value.details()


BAD = {
    "empty prompt": dict(prompt=""),
    "max_tokens 0": dict(prompt="hi", max_tokens=0),
    "max_tokens beyond context": dict(prompt="hi", max_tokens=10**6),
    "negative temperature": dict(prompt="hi", temperature=-0.5),
    "nan temperature": dict(prompt="hi", temperature=float("nan")),
    "top_p 0": dict(prompt="hi", top_p=0.0),
    "top_p above 1": dict(prompt="hi", top_p=1.5),
    "empty stop string": dict(prompt="hi", stop=[""]),
    "bad chat role": dict(messages=[("wizard", "hi")]),
    "empty chat": dict(messages=[]),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("unary", [False, True])
def test_bad_input_gets_invalid_argument_with_a_message(stub, case, unary) -> None:
    code, details = code_of(stub, client.make_request(**BAD[case]), unary)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert len(details) > 10


def test_no_input_at_all_is_invalid(stub) -> None:
    code, details = code_of(stub, gateway_pb2.GenerateRequest())
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details


def test_prompt_beyond_the_context_is_refused_at_once(stub) -> None:
    started = time.monotonic()
    code, details = code_of(stub, client.make_request(prompt=" a" * 2100, max_tokens=4))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "context" in details
    assert time.monotonic() - started < 10


def test_request_larger_than_the_kv_pool_is_refused(stub) -> None:
    code, details = code_of(stub, client.make_request(prompt=" a" * 100, max_tokens=2000))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "KV" in details


@pytest.mark.parametrize("prompt", PROMPTS)
def test_stream_concatenates_to_the_unary_result(stub, prompt) -> None:
    request = client.make_request(prompt=prompt, max_tokens=24, temperature=0.0)
    messages = list(stub.Generate(request, timeout=30))
    text = "".join(m.delta.text for m in messages[:-1])
    ids = [t for m in messages[:-1] for t in m.delta.token_ids]
    final = messages[-1].final
    unary = stub.GenerateUnary(request, timeout=30)
    assert (unary.text, list(unary.token_ids)) == (text, ids)
    assert final.usage.completion_tokens == len(ids) <= 24
    assert final.usage.prompt_tokens > 0
    assert "\ufffd" not in text or "\ufffd" in unary.text


def test_seeded_sampling_is_reproducible(stub) -> None:
    request = client.make_request(prompt="Once", max_tokens=16, temperature=1.0, seed=7)
    a, b = (stub.GenerateUnary(request, timeout=30) for _ in range(2))
    assert list(a.token_ids) == list(b.token_ids)


def test_stop_string_ends_the_output_before_it(stub) -> None:
    base = stub.GenerateUnary(
        client.make_request(prompt="Hello there", max_tokens=20, temperature=0.0, ignore_eos=True),
        timeout=30,
    )
    assert len(base.text) > 6
    stop = base.text[3:6]
    stopped = stub.GenerateUnary(
        client.make_request(
            prompt="Hello there", max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]
        ),
        timeout=30,
    )
    assert stopped.finish_reason == 1  # FINISH_REASON_STOP
    assert stopped.text == base.text[: base.text.index(stop)]


def wait_idle(target: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = client.status(target)
        kv = s.workers[0]
        if s.running == 0 and s.waiting == 0 and kv.written == 0 and kv.reserved_unwritten == 0:
            return s
        assert time.monotonic() < deadline, f"not idle: {s}"
        time.sleep(0.05)


def test_client_cancel_frees_kv(stack, stub) -> None:
    request = client.make_request(prompt="Tell me", max_tokens=900, ignore_eos=True)
    call = stub.Generate(request, timeout=60)
    got = 0
    for message in call:
        got += len(message.delta.token_ids)
        if got >= 5:
            break
    assert client.status(stack.settings.scheduler).workers[0].written > 0
    call.cancel()
    wait_idle(stack.settings.scheduler)


def test_deadline_frees_kv(stack, stub) -> None:
    request = client.make_request(prompt="Tell me", max_tokens=900, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=0.3))
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(stack.settings.scheduler)


def test_queue_limits_refuse_at_once_with_resource_exhausted(tmp_path) -> None:
    """One request runs, one waits, a third is refused: on the simulated model, each step at
    least 20 ms, the first holds its slot (1900 tokens, 38 s or more) for as long as the test
    needs on any host; both are cancelled at the end."""
    settings = tiny_settings(
        model="sim", sim_step_ms=20.0, max_running=1, max_queued_requests=1,
        max_queued_tokens=10**6,
    )  # fmt: skip
    long = client.make_request(prompt="x", max_tokens=1900, ignore_eos=True)
    with running_stack(settings, tmp_path):
        running = Held(settings.gateway, long)
        assert running.streaming.wait(30), "the first request never ran"
        queued = Held(settings.gateway, long)
        wait_for(lambda: client.status(settings.scheduler).waiting == 1, 30, "one waits")
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream(settings.gateway, long, timeout=30))
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue full" in err.value.details()
        assert time.monotonic() - started < 2
        assert not queued.streaming.is_set()  # still waiting behind the first
        running.cancel()
        queued.cancel()
        wait_idle(settings.scheduler)


def greedy_outputs(settings, tmp_path, n: int = 6) -> tuple[list[list[int]], dict]:
    with running_stack(settings, tmp_path) as s:
        results: dict[int, list[int]] = {}

        def one(i: int) -> None:
            r = client.make_request(
                prompt=PROMPTS[i % len(PROMPTS)] + f" {i}",
                max_tokens=40,
                temperature=0.0,
                ignore_eos=True,
            )
            results[i] = [
                t
                for m in client.stream(s.settings.gateway, r, timeout=120)
                for t in m.delta.token_ids
            ]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        status = client.status(s.settings.scheduler)
    return [results[i] for i in range(n)], {"preemptions": status.preemptions}


def test_preemption_loses_nothing_end_to_end(tmp_path) -> None:
    roomy, r_stats = greedy_outputs(tiny_settings(kv_capacity=4096, block_size=4), tmp_path / "a")
    tight, t_stats = greedy_outputs(tiny_settings(kv_capacity=96, block_size=4), tmp_path / "b")
    assert r_stats["preemptions"] == 0 and t_stats["preemptions"] > 0
    assert tight == roomy and all(len(o) == 40 for o in tight)


def test_chunked_prefill_matches_one_shot_end_to_end(tmp_path) -> None:
    one_shot, _ = greedy_outputs(tiny_settings(token_budget=512), tmp_path / "a", n=3)
    chunked, _ = greedy_outputs(tiny_settings(token_budget=4), tmp_path / "b", n=3)
    assert chunked == one_shot
