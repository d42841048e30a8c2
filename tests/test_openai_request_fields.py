"""Request fields of the HTTP API as the gateway reads them (no stack): logit_bias keys are token
ids in ASCII digits only; a single stop string is one stop, matched whole; chat `logprobs: true`
alone asks for logprobs; x-request-timeout past what gRPC can hold is no deadline; the HTTP
port's file-descriptor guards (connections, accepts at once, a failed accept logged once)."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest
from starlette.requests import Request

from gateway.http_api import _time_remaining
from gateway.http_errors import ApiError
from gateway.http_server import ACCEPT_BATCH, accept_batch, connection_cap, quiet_accept_errors
from gateway.openai_requests import ChatCompletionRequest, CompletionRequest
from gateway.stops import StopMatcher
from llmcommon.v1 import scheduler_pb2, scheduler_pb2_grpc


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.parse(json.dumps({"prompt": "hi", **fields}).encode())


@pytest.mark.parametrize("key", [" 3 ", "3 ", "\u0661", "1_0", "+3", "-1", "0x3", "", "3.0"])
def test_a_logit_bias_key_that_is_not_plain_digits_is_refused(key: str) -> None:
    with pytest.raises(ApiError) as err:
        completion(logit_bias={key: 1.0}).generate_input()
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.param == "logit_bias" and repr(key) in err.value.message


def test_logit_bias_keys_in_digits_are_token_ids() -> None:
    job = completion(logit_bias={"3": 1.5, "0": -2.0, "42": 100.0}).generate_input()
    assert job.sampling.logit_bias == {3: 1.5, 0: -2.0, 42: 100.0}


def test_a_single_stop_string_is_one_stop_matched_whole() -> None:
    """What the openai SDK sends for `stop="abc"`: the text runs past each of its characters
    (and past "ab", "bc") and ends only before "abc" itself."""
    stop = completion(stop="abc").generate_input().sampling.stop
    assert list(stop) == ["abc"]
    text = "a cab, b bc ab. c! abc and more"
    matcher = StopMatcher(list(stop))
    pieces = [matcher.push(text[i : i + 2]) for i in range(0, len(text), 2)]
    assert "".join(p for p, _ in pieces) == "a cab, b bc ab. c! " and pieces[-1][1]


def test_chat_logprobs_true_without_top_logprobs_asks_for_logprobs() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    job = ChatCompletionRequest.parse(json.dumps(body).encode()).generate_input()
    assert job.sampling.logprobs == 0  # the sampled tokens' logprobs, no alternatives
    del body["logprobs"]
    assert (
        ChatCompletionRequest.parse(json.dumps(body).encode()).generate_input().sampling.logprobs
        is None
    )


def request_with(headers: dict[str, str]) -> Request:
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


async def status_code_within(timeout: float | None) -> grpc.StatusCode:
    """What a gRPC call with this timeout gets from a server that implements nothing."""
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            try:
                await stub.Status(scheduler_pb2.StatusRequest(), timeout=timeout)
            except grpc.aio.AioRpcError as err:
                return err.code()
            return grpc.StatusCode.OK
    finally:
        await server.stop(None)


@pytest.mark.parametrize("header", ["1e10", "9.3e9", "1e300", "31536000000"])
def test_a_huge_request_timeout_reaches_the_scheduler_as_a_deadline_that_has_not_passed(
    header: str,
) -> None:
    """gRPC's deadline overflowed past ~9.2e9 s: such a call ended DEADLINE_EXCEEDED at once."""
    remaining = _time_remaining(request_with({"x-request-timeout": header}))()
    assert asyncio.run(status_code_within(remaining)) is grpc.StatusCode.UNIMPLEMENTED


def test_an_ordinary_request_timeout_counts_down() -> None:
    remaining = _time_remaining(request_with({"x-request-timeout": "30"}))()
    assert remaining is not None and 29 < remaining <= 30


def test_http_connections_get_at_most_half_the_open_file_limit() -> None:
    assert connection_cap(512, 1024) == 512
    assert connection_cap(900, 1024) == 512
    assert connection_cap(512, 20) == 10
    assert connection_cap(512, -1) == 512  # unlimited


def test_one_pass_of_accepts_takes_at_most_a_quarter_of_the_open_file_limit() -> None:
    assert accept_batch(1024) == ACCEPT_BATCH == 256
    assert accept_batch(400) == 100
    assert accept_batch(20) == 16  # a floor: a gateway that few files may have serves slowly
    assert accept_batch(1 << 20) == accept_batch(-1) == ACCEPT_BATCH  # large, or unlimited


def test_a_failed_accept_is_one_warning_a_pause_and_other_loop_errors_go_on(caplog) -> None:
    loop = asyncio.new_event_loop()
    seen: list[str] = []
    loop.set_exception_handler(lambda _, context: seen.append(context["message"]))
    try:
        quiet_accept_errors(loop)
        emfile = OSError(24, "Too many open files")
        with caplog.at_level(logging.WARNING, logger="gateway"):
            for _ in range(50):  # one pass of asyncio's accept loop: an error a connection
                loop.call_exception_handler(
                    {"message": "socket.accept() out of system resource", "exception": emfile}
                )
            loop.call_exception_handler({"message": "something else"})
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "cannot accept" in lines[0] and "open files" in lines[0]
        assert seen == ["something else"]  # the handler before it still gets the rest
    finally:
        loop.close()


@pytest.mark.parametrize(
    ("field", "value", "instead"),
    [
        ("functions", [{"name": "f", "parameters": {"type": "object"}}], "tools"),
        ("function_call", "auto", "tool_choice"),
        ("function_call", {"name": "f"}, "tool_choice"),
    ],
)
def test_the_deprecated_function_fields_are_refused_naming_what_to_send(field, value, instead):
    """Ignored, a client asking for a call would get text (and no `message.function_call`)."""
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    request = ChatCompletionRequest.parse(json.dumps(body).encode())
    with pytest.raises(ApiError) as err:
        request.generate_input()
    assert err.value.param == field and f"send {instead}" in str(err.value)
    neutral = {"functions": [], "function_call": "none"}[field]
    ChatCompletionRequest.parse(json.dumps(body | {field: neutral}).encode()).generate_input()


def test_completions_max_tokens_left_out_is_16_and_null_the_rest_of_the_context() -> None:
    assert completion().generate_input().sampling.max_tokens == 16
    assert completion(max_tokens=None).generate_input().sampling.max_tokens is None
    assert completion(max_tokens=5).generate_input().sampling.max_tokens == 5
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.parse(json.dumps(chat).encode()).max_tokens is None


def test_stream_options_without_stream_is_refused() -> None:
    with pytest.raises(ApiError) as err:
        completion(stream_options={"include_usage": True}).generate_input()
    assert err.value.param == "stream_options"
    completion(stream=True, stream_options={"include_usage": True}).generate_input()


@pytest.mark.parametrize(
    "fields", [{"max_completion_tokens": 0}, {"max_tokens": 5, "max_completion_tokens": -1}]
)
def test_a_bad_max_completion_tokens_is_named_as_sent(fields) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(ApiError) as err:
        ChatCompletionRequest.parse(json.dumps(body).encode()).generate_input()
    assert err.value.param == "max_completion_tokens"
    assert f"max_completion_tokens is {fields['max_completion_tokens']}" in str(err.value)
