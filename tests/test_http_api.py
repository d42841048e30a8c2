"""The gateway's OpenAI-compatible HTTP API through real processes (tiny model, fp32), with the
real `openai` package (sync, async, streaming) and with raw HTTP: the same outputs, validation,
queue limits, API key, deadlines and metrics as the gRPC API, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.generation_errors import GenerationError, QueueFull
from gateway.http_errors import from_generation
from llmserve import client
from tests.stack_checks import wait_for, wait_idle
from tests.stacks import free_port, free_run, running_stack, tiny_settings

pytestmark = pytest.mark.usefixtures("hang_guard")
KEY = "http-s3cret"
HI = {"role": "user", "content": "Hello there"}
GREEDY = {"temperature": 0, "ignore_eos": True}  # ignore_eos: the random tiny model stops anywhere


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One request runs at a time and one more may wait: a third is refused (429)."""
    settings = tiny_settings(max_running=1, max_queued_requests=1)
    ports = free_run(4, [settings.gateway_port, settings.scheduler_port, settings.worker_base_port])
    settings = replace(settings, http_port=ports + 3, metrics_base_port=ports)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LLMSERVE_API_KEY", KEY)  # read by the gateway only
        with running_stack(settings, tmp_path_factory.mktemp("http")) as s:
            yield s


@pytest.fixture(scope="module")
def model(stack) -> str:
    return client.status(stack.settings.scheduler).model


@pytest.fixture(scope="module")
def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.settings.http_url, api_key=KEY, max_retries=0, timeout=60)


def call(
    stack, method: str, path: str, body=None, key: str = KEY, headers: dict | None = None
) -> tuple[int, dict | str]:
    """(HTTP status, the body as JSON, or as text when it is not JSON)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    sent = {"content-type": "application/json"} | (headers or {})
    if key:
        sent["authorization"] = f"Bearer {key}"
    url = f"http://127.0.0.1:{stack.settings.http_port}{path}"
    request = urllib.request.Request(url, data=data, method=method, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            status, raw = reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


@contextmanager
def sent(stack, path: str, body: dict) -> Iterator[http.client.HTTPConnection]:
    """A request sent on its own connection; leaving the block disconnects."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.settings.http_port, timeout=60)
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    conn.request("POST", path, json.dumps(body), headers)
    try:
        yield conn
    finally:
        conn.close()


def events(reply: http.client.HTTPResponse) -> Iterator[str]:
    """The data of each server-sent event, as it arrives."""
    for line in reply:
        if line.startswith(b"data: "):
            yield line[6:].strip().decode()


def assert_openai_error(reply, kind: str, code: str, param: str | None = None) -> None:
    assert isinstance(reply, dict) and set(reply) == {"error"}, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert (error["type"], error["code"], error["param"]) == (kind, code, param), error
    assert len(error["message"]) > 10, error


def grpc_text(stack, **request) -> str:
    request = client.make_request(**request)
    messages = list(client.stream(stack.settings.gateway, request, timeout=60, api_key=KEY))
    return "".join(m.delta.text for m in messages[:-1])


# ---- the openai SDK ------------------------------------------------------------------------


def test_the_openai_sdk_completes_a_chat_with_usage(stack, sdk, model) -> None:
    reply = sdk.chat.completions.create(
        model=model, messages=[HI], max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.model == model and abs(reply.created - time.time()) < 60
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    _, tokens = call(stack, "POST", "/tokenize", {"messages": [HI]})
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (tokens["count"], 8)
    assert usage.total_tokens == usage.prompt_tokens + 8


def test_a_streamed_chat_concatenates_to_the_whole_reply(sdk, model) -> None:
    ask = dict(model=model, messages=[HI], max_tokens=16, extra_body=GREEDY)
    whole = sdk.chat.completions.create(**ask)
    chunks = list(sdk.chat.completions.create(**ask, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks][-2:] == [None, "length"]


def test_the_async_sdk_streams_a_completion_with_usage_last(sdk, model) -> None:
    ask = dict(model=model, prompt="Once upon a time", max_tokens=12, extra_body=GREEDY)

    async def stream() -> list:
        async with openai.AsyncOpenAI(
            base_url=str(sdk.base_url), api_key=KEY, max_retries=0, timeout=60
        ) as aclient:
            chunks = await aclient.completions.create(
                **ask, stream=True, stream_options={"include_usage": True}
            )
            return [chunk async for chunk in chunks]

    chunks = asyncio.run(stream())
    *texts, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.total_tokens == last.usage.prompt_tokens + 12
    assert all(c.usage is None and c.id.startswith("cmpl-") for c in texts)
    assert texts[-1].choices[0].finish_reason == "length"
    whole = sdk.completions.create(**ask)
    assert whole.object == "text_completion"
    assert "".join(c.choices[0].text for c in texts) == whole.choices[0].text


def test_models_lists_the_served_model(sdk, model) -> None:
    assert [m.id for m in sdk.models.list().data] == [model]
    assert sdk.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("gpt-4o")


def test_greedy_output_over_http_equals_the_grpc_output(stack, sdk, model) -> None:
    prompt = "The capital of France is"
    over_grpc = grpc_text(stack, prompt=prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
    over_http = sdk.completions.create(model=model, prompt=prompt, max_tokens=24, extra_body=GREEDY)
    assert over_http.choices[0].text == over_grpc and len(over_grpc) > 0
    chat = grpc_text(
        stack, messages=[("user", "Hello there")], max_tokens=24, temperature=0.0, ignore_eos=True
    )
    reply = sdk.chat.completions.create(
        model=model, messages=[HI], max_tokens=24, extra_body=GREEDY
    )
    assert reply.choices[0].message.content == chat


def test_a_stop_string_ends_the_text_before_it_as_on_grpc(stack, sdk, model) -> None:
    base = grpc_text(stack, prompt="Hello there", max_tokens=20, temperature=0.0, ignore_eos=True)
    stop = base[3:6]
    reply = sdk.completions.create(
        model=model, prompt="Hello there", max_tokens=20, stop=stop, extra_body=GREEDY
    )
    assert reply.choices[0].text == base[: base.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


# ---- raw HTTP --------------------------------------------------------------------------------


def test_a_stream_is_server_sent_events_ending_with_done(stack, model) -> None:
    body = {"model": model, "messages": [HI], "max_tokens": 4, "stream": True, **GREEDY}
    with sent(stack, "/v1/chat/completions", body) as conn:
        reply = conn.getresponse()
        assert reply.status == 200
        assert reply.getheader("content-type").startswith("text/event-stream")
        raw = reply.read().decode()
    *chunks, done, rest = raw.split("\n\n")
    assert (done, rest) == ("data: [DONE]", "")
    assert all(c.startswith("data: {") for c in chunks) and len(chunks) >= 3


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
BAD = {  # the path, the body, the field the error names
    "max_tokens is a string": (CMPL, {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    "temperature is a string": (CMPL, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    "content is a number": (CHAT, {"messages": [{"role": "user", "content": 5}]},
                            "messages[0].content"),
    "stop is a number": (CMPL, {"prompt": "hi", "stop": 7}, "stop"),
    "stream is a string": (CMPL, {"prompt": "hi", "stream": "yes"}, "stream"),
    "n of 0": (CHAT, {"messages": [HI], "n": 0}, "n"),
    "empty messages": (CHAT, {"messages": []}, "messages"),
    "no messages": (CHAT, {"max_tokens": 3}, "messages"),
    "a role the template does not know": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]},
                                          "messages[0].role"),
    "empty prompt": (CMPL, {"prompt": ""}, "prompt"),
    "token ids as the prompt": (CMPL, {"prompt": [1, 2, 3]}, "prompt"),
    "negative temperature": (CMPL, {"prompt": "hi", "temperature": -1}, "temperature"),
    "top_p above 1": (CMPL, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    "max_tokens of 0": (CMPL, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "an empty stop": (CMPL, {"prompt": "hi", "stop": ["a", ""]}, "stop"),
    "17 stops": (CMPL, {"prompt": "hi", "stop": [str(i) for i in range(17)]}, "stop"),
    "top_logprobs without logprobs": (CHAT, {"messages": [HI], "top_logprobs": 2}, "top_logprobs"),
    "logprobs above 20": (CMPL, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    "a body that is not JSON": (CMPL, b"{not json", None),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_request_is_400_in_openai_shape_naming_the_field(stack, case) -> None:
    path, body, param = BAD[case]
    status, reply = call(stack, "POST", path, body)
    assert status == 400, reply
    assert_openai_error(reply, "invalid_request_error", "invalid_argument", param)


def test_max_tokens_beyond_the_context_is_a_context_overflow(stack) -> None:
    status, reply = call(stack, "POST", CMPL, {"prompt": "hi", "max_tokens": 10**6})
    assert status == 400, reply
    assert_openai_error(reply, "invalid_request_error", "context_length_exceeded", "max_tokens")
    assert "maximum context length" in reply["error"]["message"]


def test_unknown_fields_are_ignored_as_openai_servers_do(stack) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "user": "me", "frequency_penalty": 0, "x": {"y": 1}}
    status, reply = call(stack, "POST", "/v1/completions", body)
    assert status == 200 and reply["usage"]["completion_tokens"] <= 2


@pytest.mark.parametrize("key", ["", "wrong"], ids=["no key", "a wrong key"])
def test_a_missing_or_wrong_key_is_401_and_health_stays_open(stack, sdk, key) -> None:
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", {"messages": [HI]}),
        ("POST", "/v1/completions", {"prompt": "hi"}),
        ("POST", "/tokenize", {"prompt": "hi"}),
    ]:
        status, reply = call(stack, method, path, body, key=key)
        assert status == 401, (path, reply)
        assert_openai_error(reply, "authentication_error", "unauthenticated")
    assert call(stack, "GET", "/health", key="") == (200, "")
    with pytest.raises(openai.AuthenticationError):
        sdk.with_options(api_key=key or "none").models.list()


def test_two_different_keys_are_401_saying_so_and_one_key_twice_is_served(stack) -> None:
    """The right key beside a different `x-api-key` is refused: which of them named the tenant
    would hang on the headers' order."""
    status, reply = call(stack, "GET", "/v1/models", key=KEY, headers={"x-api-key": "other"})
    assert status == 401, reply
    assert_openai_error(reply, "authentication_error", "unauthenticated")
    assert "two different API keys" in reply["error"]["message"]
    assert call(stack, "GET", "/v1/models", key=KEY, headers={"x-api-key": KEY})[0] == 200


def test_an_unknown_model_or_route_is_404(stack, sdk) -> None:
    status, reply = call(stack, "POST", "/v1/completions", {"model": "gpt-4o", "prompt": "hi"})
    assert status == 404
    assert_openai_error(reply, "invalid_request_error", "not_found", "model")
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="gpt-4o", messages=[HI])
    for method, path in [("GET", "/v1/nothing"), ("POST", "/v1/embeddings")]:
        status, reply = call(stack, method, path, {} if method == "POST" else None)
        assert status == 404
        assert_openai_error(reply, "invalid_request_error", "not_found")


def test_another_method_on_a_known_route_is_405_in_openai_shape(stack) -> None:
    for method, path in [("GET", "/v1/chat/completions"), ("POST", "/v1/models")]:
        status, reply = call(stack, method, path, {} if method == "POST" else None)
        assert status == 405, (path, reply)
        assert_openai_error(reply, "invalid_request_error", "unimplemented")


def test_tokenize_and_detokenize_round_trip(stack) -> None:
    text = "Hello world, 日本語 🙂"
    status, tokens = call(stack, "POST", "/tokenize", {"prompt": text})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 3
    assert tokens["max_model_len"] == client.status(stack.settings.scheduler).max_context
    assert call(stack, "POST", "/detokenize", {"tokens": tokens["tokens"]}) == (
        200,
        {"prompt": text},
    )
    status, reply = call(stack, "POST", "/detokenize", {"tokens": [10**9]})
    assert status == 400
    assert_openai_error(reply, "invalid_request_error", "invalid_argument", "tokens")


def test_a_full_queue_is_429_over_http_and_resource_exhausted_over_grpc(stack, sdk, model) -> None:
    """One request runs, one waits (the limit): a third is refused at once, whatever its
    protocol; the waiting one's client leaves before its first token, the running one's during
    its stream, and both free their place."""
    long = {"prompt": "x", "max_tokens": 1900, "stream": True, "ignore_eos": True}
    scheduler = stack.settings.scheduler
    with sent(stack, "/v1/completions", long) as running:
        assert running.getresponse().status == 200  # its first token came
        with sent(stack, "/v1/completions", long):
            wait_for(lambda: client.status(scheduler).waiting == 1, 10, "a request waiting")
            started = time.monotonic()
            status, reply = call(stack, "POST", "/v1/completions", {"prompt": "hi"})
            assert status == 429 and "queue full" in reply["error"]["message"]
            assert_openai_error(reply, "rate_limit_error", "resource_exhausted")
            with pytest.raises(openai.RateLimitError) as limited:
                sdk.completions.create(model=model, prompt="hi", max_tokens=2)
            assert limited.value.response.headers["retry-after"] == "1"
            with pytest.raises(grpc.RpcError) as err:
                grpc_text(stack, prompt="hi", max_tokens=2)
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - started < 5
    wait_idle(scheduler, timeout=10)
    assert call(stack, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200


def test_only_the_queue_limits_are_429_and_the_schedulers_refusals_keep_their_meaning() -> None:
    """A request larger than the KV pool can never run: 400, not a 429 that clients retry; the
    scheduler refusing the gateway's internal token is the stack's fault, not the client's key."""
    exhausted, denied = grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED
    assert from_generation(QueueFull("queue full: 1 requests are waiting")).status == 429
    assert from_generation(GenerationError(exhausted, "larger than the KV pool")).status == 400
    assert from_generation(GenerationError(denied, "missing or wrong internal token")).status == 503


def test_a_client_that_disconnects_mid_stream_frees_its_kv(stack) -> None:
    scheduler = stack.settings.scheduler
    generated = client.status(scheduler).generated_tokens
    long = {"prompt": "Tell me", "max_tokens": 1900, "stream": True, "ignore_eos": True}
    with sent(stack, "/v1/completions", long) as conn:
        reply = conn.getresponse()
        for got, _ in enumerate(events(reply)):
            if got == 5:
                break
        assert client.status(scheduler).workers[0].written > 0
    status = wait_idle(scheduler, timeout=10)
    assert status.generated_tokens - generated < 1900  # cut short, not run to its end


def test_a_passed_deadline_is_504_and_frees_kv(stack) -> None:
    long = {"prompt": "Tell me", "max_tokens": 1900, "ignore_eos": True}
    status, reply = call(
        stack, "POST", "/v1/completions", long, headers={"x-request-timeout": "0.3"}
    )
    assert status == 504
    assert_openai_error(reply, "timeout_error", "deadline_exceeded")
    wait_idle(stack.settings.scheduler, timeout=10)
    status, reply = call(
        stack, "POST", "/v1/completions", long, headers={"x-request-timeout": "soon"}
    )
    assert status == 400
    assert_openai_error(reply, "invalid_request_error", "invalid_argument", "x-request-timeout")


def samples(stack, name: str) -> list[tuple[dict[str, str], float]]:
    """The gateway's samples of `name`: (labels, value)."""
    url = f"http://127.0.0.1:{stack.settings.metrics_port(0)}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def http_calls(stack) -> dict[tuple[str, str, str], float]:
    return {
        (labels["method"], labels["code"], labels["protocol"]): value
        for labels, value in samples(stack, "llmserve_gateway_requests_total")
    }


def test_http_calls_are_counted_with_protocol_http_beside_grpc(stack, sdk, model) -> None:
    before = http_calls(stack)
    sdk.chat.completions.create(model=model, messages=[HI], max_tokens=2)
    call(stack, "POST", "/v1/completions", {"prompt": ""})
    call(stack, "POST", "/v1/completions", {"prompt": "hi"}, key="wrong")
    grpc_text(stack, prompt="hi", max_tokens=2)
    after = http_calls(stack)
    grown = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert grown == {
        ("/v1/chat/completions", "OK", "http"): 1,
        ("/v1/completions", "INVALID_ARGUMENT", "http"): 1,
        ("/v1/completions", "UNAUTHENTICATED", "http"): 1,
        ("Generate", "OK", "grpc"): 1,
    }
    # the streams cut short by their clients (earlier tests) are not in flight any more
    assert samples(stack, "llmserve_gateway_requests_in_flight") == [({}, 0)]


def test_sigterm_lets_a_stream_finish_then_the_gateway_exits_0(stack) -> None:
    """The gateway's drain covers its HTTP streams as it covers gRPC calls."""
    body = {"prompt": "x", "max_tokens": 100, "stream": True, "ignore_eos": True}
    gateway = stack.procs["gateway"]
    with sent(stack, "/v1/completions", body) as conn:
        reply = conn.getresponse()
        reply.readline()  # its first chunk
        gateway.send_signal(signal.SIGTERM)
        *chunks, last = list(events(reply))
    assert last == "[DONE]" and json.loads(chunks[-1])["choices"][0]["finish_reason"] == "length"
    assert gateway.wait(30) == 0
    stack.restart("gateway")


def test_a_port_in_use_stops_the_gateway_at_start(stack) -> None:
    command = [sys.executable, "-m", "gateway", "--port", str(free_port()), "--scheduler",
               stack.settings.scheduler, "--http-port", str(stack.settings.http_port)]  # fmt: skip
    ended = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert ended.returncode != 0
    assert f"cannot listen on 127.0.0.1:{stack.settings.http_port} for HTTP" in ended.stderr


def test_without_its_scheduler_the_api_answers_503(stack) -> None:
    """Last: it kills the module's scheduler."""
    stack.procs["scheduler"].kill()
    stack.procs["scheduler"].wait()
    status, reply = call(stack, "GET", "/health")
    assert status == 503
    assert_openai_error(reply, "server_error", "unavailable")
    status, reply = call(stack, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 503 and "scheduler" in reply["error"]["message"]
    assert_openai_error(reply, "server_error", "unavailable")
