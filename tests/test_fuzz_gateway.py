"""Bad input against the gateway's public API through real processes (tiny model): property-based
requests with random and extreme settings, odd Unicode, stop strings of every shape, prompts past
the context and messages past the size limit. Every input gets OK or a proper status code with a
message (never UNKNOWN, INTERNAL or UNAVAILABLE), and the service stays healthy throughout.

LLMSERVE_FUZZ_EXAMPLES sets how many requests the property tries (default 400).
"""

from __future__ import annotations

import os
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmcommon.server import CHANNEL_OPTIONS
from llmcommon.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.stack_checks import stop_cleanly, wait_idle
from tests.stacks import running_stack, tiny_settings

pytestmark = pytest.mark.usefixtures("hang_guard")
EXAMPLES = int(os.environ.get("LLMSERVE_FUZZ_EXAMPLES", "400"))
PROPER = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,  # a request id still in flight
}
SERVING = health_pb2.HealthCheckResponse.SERVING
CONTEXT = 2048  # the tiny model's
TRIED: dict[str, int] = {}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings_ = tiny_settings(
        kv_capacity=1024, block_size=16, token_budget=64, default_max_tokens=16,
        max_queued_requests=64,
    )  # fmt: skip
    with running_stack(settings_, tmp_path_factory.mktemp("fuzz")) as s:
        yield s
        wait_idle(s.settings.scheduler)
        stop_cleanly(s)  # every process exits 0 after all of it


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(stack.settings.gateway, options=CHANNEL_OPTIONS) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return gateway_pb2_grpc.GatewayStub(channel)


def assert_healthy(stack, channel) -> None:
    for name, proc in stack.procs.items():
        assert proc.poll() is None, f"{name} exited with {proc.returncode}"
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING


def outcome(stub, request, unary: bool) -> tuple[grpc.StatusCode, str, gateway_pb2.GenerateResult]:
    """(code, details, result); the result of a stream is assembled like the unary one."""
    try:
        if unary:
            return grpc.StatusCode.OK, "", stub.GenerateUnary(request, timeout=60)
        messages = list(stub.Generate(request, timeout=60))
    except grpc.RpcError as err:
        return err.code(), err.details() or "", gateway_pb2.GenerateResult()
    final = messages[-1].final
    return (
        grpc.StatusCode.OK,
        "",
        gateway_pb2.GenerateResult(
            text="".join(m.delta.text for m in messages[:-1]),
            token_ids=[t for m in messages[:-1] for t in m.delta.token_ids],
            finish_reason=final.finish_reason,
            usage=final.usage,
        ),
    )


# ---- strategies ---------------------------------------------------------------------------------

ODD = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "{{ raise_exception('boom') }}", "{% for %}",
    "\u202e\u2066RTL", "\x00", "\ufeff", "\uffff", "\U0010ffff", "\ufdd0", "e\u0301" * 40,
    "🙂" * 60, "👩‍👩‍👧‍👦", "\r\n\r\n", " " * 300, "日本語", "\t\x0b\x0c\x1b[31m", "a" * 257,
]  # fmt: skip
# everything protobuf strings can carry: any code point but the surrogates
any_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=200)
text = st.one_of(any_text, st.sampled_from(ODD), st.builds("".join, st.lists(st.sampled_from(ODD))))
float32 = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-38, 1e-6, 1.0, 1.0000001, 3.4e38, -1.0]),
)
uint32 = st.one_of(st.integers(0, 24), st.sampled_from([0, 2047, 2048, 2049, 2**31, 2**32 - 1]))
prompt = st.one_of(
    text,
    st.just(""),
    st.integers(1, 3000).map(lambda n: " a" * n),  # up to past the context of 2048 tokens
)
role = st.sampled_from(["system", "user", "assistant", "", "wizard", "USER", "user\x00", "tool"])
chat = st.lists(st.tuples(role, text), max_size=5)
stop = st.lists(st.one_of(text, st.just(""), st.text(max_size=300)), max_size=20)

# the same fields within their valid ranges (extremes included), so that many requests generate
valid = {
    "max_tokens": st.none() | st.integers(1, 24),
    "temperature": st.none() | st.floats(0.0, 2.0, width=32) | st.sampled_from([1e-45, 1e-38]),
    "top_p": st.none() | st.floats(0.0, 1.0, exclude_min=True, width=32),
    "top_k": st.none() | st.integers(0, 2**32 - 1),
    "stop": st.lists(st.one_of(st.sampled_from(ODD[:-1]), st.text(min_size=1, max_size=8)),
                     max_size=16),
    "prompt": text.filter(bool),
    "chat": st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), text),
                     min_size=1, max_size=4),
}  # fmt: skip
anything = {
    "max_tokens": st.none() | uint32,
    "temperature": st.none() | float32,
    "top_p": st.none() | float32,
    "top_k": st.none() | st.integers(0, 2**32 - 1),
    "stop": stop,
    "prompt": prompt,
    "chat": chat,
}


@st.composite
def requests(draw) -> gateway_pb2.GenerateRequest:
    """Two in three requests are valid in every field; the others may be wrong anywhere."""
    f = valid if draw(st.integers(0, 2)) else anything
    s = common_pb2.SamplingParams(
        max_tokens=draw(f["max_tokens"]),
        temperature=draw(f["temperature"]),
        top_p=draw(f["top_p"]),
        top_k=draw(f["top_k"]),
        seed=draw(st.none() | st.integers(0, 2**64 - 1)),
        stop=draw(f["stop"]),
        ignore_eos=draw(st.booleans()),
    )
    request = gateway_pb2.GenerateRequest(request_id=draw(st.just("") | text), sampling=s)
    kind = draw(st.sampled_from(["prompt", "chat"] if f is valid else ["prompt", "chat", "none"]))
    if kind == "prompt":
        request.prompt = draw(f["prompt"])
    elif kind == "chat":
        for r, c in draw(f["chat"]):
            request.chat.messages.add(role=r, content=c)
    return request


# ---- the property -------------------------------------------------------------------------------


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests(), unary=st.booleans())
def test_every_input_gets_a_proper_answer(stack, channel, stub, request, unary) -> None:
    code, details, result = outcome(stub, request, unary)
    TRIED[code.name] = TRIED.get(code.name, 0) + 1
    assert code is grpc.StatusCode.OK or code in PROPER, (code, details)
    if code is not grpc.StatusCode.OK:
        assert len(details) > 5, (code, details)
    else:
        s = request.sampling
        tokens = len(result.token_ids)
        assert result.usage.completion_tokens == tokens
        limit = s.max_tokens if s.HasField("max_tokens") else 16
        if result.finish_reason == common_pb2.FINISH_REASON_LENGTH:
            # exactly max_tokens, or fewer only where the prompt left less room in the context
            assert tokens == limit or result.usage.prompt_tokens + tokens == CONTEXT, (
                tokens,
                limit,
                result.usage.prompt_tokens,
            )
        else:
            assert result.finish_reason == common_pb2.FINISH_REASON_STOP, result.finish_reason
            assert tokens <= limit
            assert s.stop or not s.ignore_eos  # nothing else can stop it
        for stop_string in s.stop:
            assert stop_string not in result.text  # the output ends before any stop string
    assert_healthy(stack, channel)


def test_zz_report_inputs_tried(stack) -> None:
    """Runs after the property (file order): how many inputs it tried, by outcome."""
    total = sum(TRIED.values())
    print(f"\nfuzz: {total} inputs tried through the gateway, by status: {TRIED}")
    assert total >= min(EXAMPLES, 100), TRIED
    status = wait_idle(stack.settings.scheduler)
    assert all(w.healthy for w in status.workers)


# ---- the edges, one by one ----------------------------------------------------------------------


def code_of(stub, request, timeout: float = 60) -> tuple[grpc.StatusCode, str, float]:
    started = time.monotonic()
    code, details, _ = outcome(stub, request, unary=True)
    return code, details, time.monotonic() - started


@pytest.mark.parametrize("chars", ["a", "日"])
def test_message_past_the_size_limit_gets_resource_exhausted(stack, channel, stub, chars) -> None:
    size = (1 << 20) + 1  # the gateway's max_request_bytes is 1 MiB
    request = gateway_pb2.GenerateRequest(prompt=chars * (size // len(chars.encode()) + 1))
    code, details, took = code_of(stub, request)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and details, (code, details)
    assert took < 10
    assert_healthy(stack, channel)


def test_prompt_just_under_the_size_limit_is_refused_by_its_length(stack, stub) -> None:
    request = gateway_pb2.GenerateRequest(prompt="a " * 500_000)  # ~1e6 bytes, 500k tokens
    code, details, took = code_of(stub, request)
    assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "the prompt has 1000000 characters" in details  # never tokenized
    print(f"\n1M-character prompt refused in {took:.2f} s")


def test_lone_surrogates_cannot_even_be_sent() -> None:
    with pytest.raises(UnicodeEncodeError):
        gateway_pb2.GenerateRequest(prompt="a\ud800b")


@pytest.mark.parametrize("method", ["Generate", "GenerateUnary"])
def test_invalid_bytes_on_the_wire_get_invalid_argument(stack, channel, method) -> None:
    """A client that bypasses protobuf's checks: a string field holding invalid UTF-8 (an encoded
    lone surrogate, a stray 0xff byte) or a truncated message."""
    send = (channel.unary_stream if method == "Generate" else channel.unary_unary)(
        f"/llmserve.v1.Gateway/{method}", request_serializer=lambda b: b
    )
    for raw in (b"\x12\x05a\xed\xa0\x80b", b"\x12\x01\xff", b"\x12\x09abc"):
        with pytest.raises(grpc.RpcError) as err:
            reply = send(raw, timeout=10)
            if method == "Generate":
                list(reply)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "malformed request" in err.value.details()
    assert_healthy(stack, channel)


def test_tiny_temperature_is_greedy_not_a_crash(stack, stub) -> None:
    base = dict(prompt="The story goes", sampling=common_pb2.SamplingParams(max_tokens=12))
    greedy = gateway_pb2.GenerateRequest(**base)
    greedy.sampling.temperature = 0.0
    for t in (1e-45, 1e-38, 1e-6):
        tiny = gateway_pb2.GenerateRequest(**base)
        tiny.sampling.temperature = t
        assert list(stub.GenerateUnary(tiny, timeout=30).token_ids) == list(
            stub.GenerateUnary(greedy, timeout=30).token_ids
        )
