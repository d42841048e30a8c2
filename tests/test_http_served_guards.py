"""The HTTP front end of a real gateway (tiny model, fp32, real processes) under clients that
misbehave: connections past --http-max-connections are refused while the gRPC API on the same
gateway keeps serving; a client that leaves mid-body is a cancellation, not a server error; a
huge x-request-timeout is served. And two behaviours of the OpenAI API pinned down: a single
`stop` string, and chat `logprobs: true` without `top_logprobs`."""

from __future__ import annotations

import http.client
import json
import os
import resource
import signal
import socket
import urllib.request
from dataclasses import replace

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve import client
from tests.stack_checks import wait_for
from tests.stacks import free_run, running_stack, tiny_settings

pytestmark = pytest.mark.usefixtures("hang_guard")
CAP = 8
BOUND_S = 60.0
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings = tiny_settings()
    ports = free_run(4, [settings.gateway_port, settings.scheduler_port, settings.worker_base_port])
    settings = replace(settings, http_port=ports + 3, metrics_base_port=ports)
    with pytest.MonkeyPatch.context() as env:  # read by the gateway only
        env.setenv("LLMSERVE_GATEWAY_HTTP_MAX_CONNECTIONS", str(CAP))
        env.setenv("LLMSERVE_GATEWAY_HTTP_HEADER_TIMEOUT", "600")  # held sockets stay open
        with running_stack(settings, tmp_path_factory.mktemp("guards")) as s:
            yield s


@pytest.fixture(scope="module")
def model(stack) -> str:
    return client.status(stack.settings.scheduler).model


@pytest.fixture(scope="module")
def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.settings.http_url, api_key="-", max_retries=0, timeout=60)


def connect(stack) -> socket.socket:
    return socket.create_connection(("127.0.0.1", stack.settings.http_port), timeout=BOUND_S)


def until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the timeout)."""
    got = b""
    while chunk := sock.recv(1 << 16):
        got += chunk
    return got


def models_status(stack) -> int | None:
    """GET /v1/models on a new connection: its status, or None when the connection is refused
    or closed without an answer."""
    try:
        url = f"http://127.0.0.1:{stack.settings.http_port}/v1/models"
        with urllib.request.urlopen(url, timeout=BOUND_S) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code
    except (ConnectionError, urllib.error.URLError, http.client.HTTPException):
        return None


def http_calls(stack) -> dict[tuple[str, str], float]:
    url = f"http://127.0.0.1:{stack.settings.metrics_port(0)}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.labels["method"], s.labels["code"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llmserve_gateway_requests_total" and s.labels["protocol"] == "http"
    }


def test_past_the_connection_cap_http_is_refused_while_grpc_generate_succeeds(stack) -> None:
    held = [connect(stack) for _ in range(CAP)]  # idle: no byte sent, as a slowloris's
    try:
        # accepted in order: once the gateway answers the next one, it holds all of them
        with connect(stack) as extra:
            refused = until_closed(extra)
        assert refused.startswith(b"HTTP/1.1 503"), refused
        assert json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "unavailable"
        assert models_status(stack) in (503, None)  # a real client is refused too
        request = client.make_request(prompt="Hello", max_tokens=4, temperature=0.0)
        *_, last = client.stream(stack.settings.gateway, request, timeout=60)
        assert last.final.usage.completion_tokens == 4  # the gRPC API is unharmed
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: models_status(stack) == 200, BOUND_S, "HTTP served again once freed")


def test_1100_idle_partial_heads_leave_a_gateway_of_1024_files_serving_grpc(stack) -> None:
    """The slowloris of the issue: before the cap, the HTTP side took every file descriptor and
    every new gRPC client timed out. The gateway is stopped while the 1,100 connect, so that
    they all wait for it at once on any host: uvicorn's backlog of 2,048 then let one pass of
    its loop accept every one of them before any was refused and closed (EMFILE: accepting
    paused, gRPC's accepts failing too, a traceback a connection in its log)."""
    gateway = stack.procs["gateway"].pid
    limits = resource.prlimit(gateway, resource.RLIMIT_NOFILE)
    resource.prlimit(gateway, resource.RLIMIT_NOFILE, (1024, limits[1]))
    heads: list[socket.socket] = []
    try:
        os.kill(gateway, signal.SIGSTOP)
        try:
            for _ in range(1100):  # each connects in the kernel, or waits there for room
                heads.append(socket.socket())
                heads[-1].setblocking(False)
                heads[-1].connect_ex(("127.0.0.1", stack.settings.http_port))
        finally:
            os.kill(gateway, signal.SIGCONT)
        for sock in heads:
            sock.settimeout(BOUND_S)
            try:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            except OSError:  # refused and closed already: it still holds its socket here
                pass
        request = client.make_request(prompt="Hello", max_tokens=4, temperature=0.0)
        *_, last = client.stream(stack.settings.gateway, request, timeout=30)
        assert last.final.usage.completion_tokens == 4
    finally:
        for sock in heads:
            sock.close()
        resource.prlimit(gateway, resource.RLIMIT_NOFILE, limits)
    wait_for(lambda: models_status(stack) == 200, BOUND_S, "HTTP served again once freed")
    log = stack.log("gateway").read_text()
    ran_out = ("out of system resource", "cannot accept", "File descriptor limit", "Traceback")
    assert not [words for words in ran_out if words in log], log[-2000:]


def test_a_client_gone_mid_body_is_a_cancellation_not_a_server_error(stack) -> None:
    path = "/v1/completions"
    before = http_calls(stack)
    with connect(stack) as sock:
        head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        sock.sendall(f"{head}content-length: 1000\r\n\r\n".encode() + b'{"prompt": "Hel')

    def cancelled() -> bool:
        return (
            http_calls(stack).get((path, "CANCELLED"), 0) == before.get((path, "CANCELLED"), 0) + 1
        )

    wait_for(cancelled, BOUND_S, "the request counted CANCELLED")
    assert http_calls(stack).get((path, "INTERNAL"), 0) == before.get((path, "INTERNAL"), 0)
    log = stack.log("gateway").read_text()
    assert "Traceback" not in log and "ClientDisconnect" not in log


@pytest.mark.parametrize("seconds", ["1e10", "1e300"])
def test_a_huge_request_timeout_is_served_not_504(stack, sdk, model, seconds) -> None:
    reply = sdk.completions.create(
        model=model, prompt="Hello", max_tokens=3, extra_headers={"x-request-timeout": seconds},
        extra_body=GREEDY,
    )  # fmt: skip
    assert reply.usage.completion_tokens == 3


def test_a_single_stop_string_ends_the_text_only_where_it_appears_whole(stack, sdk, model) -> None:
    """The openai SDK sends `stop="..."` as one string: the text ends before its first whole
    occurrence, though its characters appear earlier."""
    whole = (
        sdk.completions.create(
            model=model, prompt="Once upon a time", max_tokens=48, extra_body=GREEDY
        )
        .choices[0]
        .text
    )
    stop = next(
        (whole[i : i + 3] for i in range(1, len(whole) - 3)
         if whole[i : i + 3].strip() and any(c in whole[: whole.find(whole[i : i + 3])]
                                              for c in whole[i : i + 3])),
        None,
    )  # fmt: skip
    assert stop is not None, whole  # the tiny model's text repeats characters
    cut = sdk.completions.create(
        model=model, prompt="Once upon a time", max_tokens=48, stop=stop, extra_body=GREEDY
    ).choices[0]
    assert cut.text == whole[: whole.find(stop)] and cut.finish_reason == "stop"


def test_chat_logprobs_without_top_logprobs_returns_each_tokens_logprob(stack, sdk, model) -> None:
    reply = sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True,
        extra_body=GREEDY,
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    assert all(entry.logprob <= 0 and entry.top_logprobs == [] for entry in content)
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
