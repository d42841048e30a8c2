"""The API key and the internal token as the interceptors see them, in-process: which calls pass,
which are refused and how, whatever byte of the secret is wrong; where the token comes from."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import grpc
import pytest

from gateway.auth import KEYS_DISAGREE, PROTECTED_SERVICE, ApiKeyInterceptor, key_from_metadata
from llmcommon.auth import (
    INTERNAL_REFUSAL,
    INTERNAL_TOKEN_HEADER,
    INTERNAL_TOKEN_VAR,
    TokenInterceptor,
    internal_token,
    internal_token_of,
    token_interceptors,
    token_metadata,
)

KEY = "s3cret-Key-0123456789"
GENERATE = f"/{PROTECTED_SERVICE}/Generate"
HEALTH = "/grpc.health.v1.Health/Check"


def near_misses(secret: str) -> dict[str, str]:
    """Wrong secrets that share most bytes with `secret`: a compare that stops early, or looks
    at a prefix only, lets one of them through."""
    last = secret[-1]
    return {
        "empty": "",
        "first byte": ("t" if secret[0] != "t" else "u") + secret[1:],
        "middle byte": secret[:8] + ("x" if secret[8] != "x" else "y") + secret[9:],
        "last byte": secret[:-1] + ("0" if last != "0" else "1"),
        "a prefix": secret[:-1],
        "one byte more": secret + "0",
        "another case": secret.swapcase(),
    }


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


async def served(request, context) -> str:
    return "served"


async def served_stream(request, context):
    yield "served"


HANDLERS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler(served),
    "unary_stream": grpc.unary_stream_rpc_method_handler(served_stream),
    "stream_unary": grpc.stream_unary_rpc_method_handler(served),
    "stream_stream": grpc.stream_stream_rpc_method_handler(served_stream),
}


def call(interceptor, method: str, metadata, kind: str = "unary_unary") -> str:
    """Run one call through `interceptor`: "served", or the code and details of the refusal."""
    handler = HANDLERS[kind]

    async def continuation(details):
        return {method: handler}.get(details.method)  # the server's lookup by method

    async def run() -> str:
        details = SimpleNamespace(method=method, invocation_metadata=metadata)
        chosen = await interceptor.intercept_service(continuation, details)
        assert (chosen.request_streaming, chosen.response_streaming) == (
            handler.request_streaming,
            handler.response_streaming,
        )
        behaviour = getattr(chosen, kind)
        try:
            if chosen.response_streaming:
                return "".join([m async for m in behaviour(None, Context())])
            return await behaviour(None, Context())
        except Aborted as err:
            return f"{err.code.name}: {err.details}"

    return asyncio.run(run())


# ---- the public API key --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ((("x-api-key", KEY),), KEY),
        ((("authorization", f"Bearer {KEY}"),), KEY),
        ((("authorization", f"bearer   {KEY} "),), KEY),  # the scheme in any case, spaces
        ((("authorization", f"BEARER {KEY}".encode()),), KEY),  # a binary value
        ((("x-api-key", KEY.encode()),), KEY),
        ((("authorization", f"Basic {KEY}"),), ""),  # another scheme carries no key
        ((("x-other", KEY),), ""),
        ((), ""),
        (None, ""),
    ],
)
def test_the_api_key_is_read_from_either_header(metadata, key) -> None:
    assert key_from_metadata(metadata) == key


def test_binary_metadata_of_any_bytes_is_passed_over_not_decoded() -> None:
    """`-bin` entries (tracing's) may hold any bytes: before the key, or alone."""
    traced = (("x-trace-bin", b"\xff\xfe"), ("authorization", "Bearer k"))
    assert key_from_metadata(traced) == "k"
    assert key_from_metadata((("x-trace-bin", b"\xff"),)) == ""
    assert call(ApiKeyInterceptor("k"), GENERATE, traced) == "served"


def test_the_same_key_in_both_headers_is_that_key() -> None:
    both = (("x-other", "a"), ("x-api-key", KEY), ("authorization", f"Bearer {KEY}"))
    assert key_from_metadata(both) == KEY
    assert call(ApiKeyInterceptor(KEY), GENERATE, both) == "served"
    other_scheme = (("authorization", "Basic zzz"), ("x-api-key", KEY))  # carries no key
    assert call(ApiKeyInterceptor(KEY), GENERATE, other_scheme) == "served"


@pytest.mark.parametrize(
    "metadata",
    [
        (("authorization", f"Bearer {KEY}"), ("x-api-key", "other")),
        (("x-api-key", "other"), ("authorization", f"Bearer {KEY}")),
        (("x-api-key", KEY), ("x-api-key", "other")),
    ],
)
def test_keys_that_disagree_are_refused_whichever_comes_first(metadata) -> None:
    """Which key named the tenant would otherwise hang on the headers' order (it had been the
    first): both orders are refused, saying why, even when one of the keys is right."""
    answer = call(ApiKeyInterceptor(KEY), GENERATE, metadata)
    assert answer == f"UNAUTHENTICATED: {KEYS_DISAGREE}"


@pytest.mark.parametrize("kind", list(HANDLERS))
@pytest.mark.parametrize("header", ["x-api-key", "authorization"])
def test_the_right_api_key_is_served_on_every_kind_of_call(kind, header) -> None:
    value = KEY if header == "x-api-key" else f"Bearer {KEY}"
    assert call(ApiKeyInterceptor(KEY), GENERATE, ((header, value),), kind) == "served"


@pytest.mark.parametrize("kind", list(HANDLERS))
@pytest.mark.parametrize("miss", list(near_misses(KEY)))
def test_a_key_wrong_in_any_byte_is_refused_on_every_kind_of_call(kind, miss) -> None:
    wrong = near_misses(KEY)[miss]
    answer = call(ApiKeyInterceptor(KEY), GENERATE, (("x-api-key", wrong),), kind)
    assert answer == ("UNAUTHENTICATED: missing or wrong API key: send `authorization: Bearer KEY`")


def test_without_a_key_the_gateway_refuses_every_call() -> None:
    assert call(ApiKeyInterceptor(KEY), GENERATE, ()).startswith("UNAUTHENTICATED")


@pytest.mark.parametrize("method", [HEALTH, "/grpc.reflection.v1alpha.ServerReflection/Info"])
def test_health_and_reflection_stay_open_without_the_key(method) -> None:
    assert call(ApiKeyInterceptor(KEY), method, ()) == "served"


def test_an_unknown_method_is_left_to_grpc() -> None:
    async def continuation(details):
        return None  # no such method: grpc answers UNIMPLEMENTED itself

    details = SimpleNamespace(method=f"/{PROTECTED_SERVICE}/Nope", invocation_metadata=())
    assert asyncio.run(ApiKeyInterceptor(KEY).intercept_service(continuation, details)) is None


# ---- the internal token --------------------------------------------------------------------

TOKEN = "llmserve-0123456789abcdef"
SCHEDULER = "/llmserve.v1.Scheduler/Submit"


def internal(token: str = TOKEN) -> TokenInterceptor:
    return TokenInterceptor(["llmserve.v1.Scheduler"], token)


def test_the_internal_token_is_served_and_every_near_miss_refused() -> None:
    assert call(internal(), SCHEDULER, ((INTERNAL_TOKEN_HEADER, TOKEN),)) == "served"
    assert call(internal(), SCHEDULER, ((INTERNAL_TOKEN_HEADER, TOKEN.encode()),)) == "served"
    for miss, wrong in near_misses(TOKEN).items():
        answer = call(internal(), SCHEDULER, ((INTERNAL_TOKEN_HEADER, wrong),))
        assert answer == f"UNAUTHENTICATED: {INTERNAL_REFUSAL}", miss


def test_the_internal_token_travels_only_in_its_own_header() -> None:
    assert internal_token_of((("x-api-key", TOKEN), (INTERNAL_TOKEN_HEADER, "t"))) == "t"
    assert internal_token_of((("authorization", f"Bearer {TOKEN}"),)) == ""
    assert call(internal(), SCHEDULER, (("x-api-key", TOKEN),)).startswith("UNAUTHENTICATED")


def test_a_service_not_named_is_left_open() -> None:
    assert call(internal(), "/llmserve.v1.Worker/Describe", ()) == "served"


def test_calls_carry_the_token_only_when_there_is_one() -> None:
    assert token_metadata("") == () and token_interceptors("") == []
    assert token_metadata(TOKEN) == ((INTERNAL_TOKEN_HEADER, TOKEN),)


def test_every_kind_of_client_call_sends_the_token_with_its_own_metadata() -> None:
    interceptors = token_interceptors(TOKEN)
    kinds = [
        grpc.aio.UnaryUnaryClientInterceptor,
        grpc.aio.UnaryStreamClientInterceptor,
        grpc.aio.StreamUnaryClientInterceptor,
        grpc.aio.StreamStreamClientInterceptor,
    ]
    assert [type(i).__mro__[2] for i in interceptors] == kinds
    methods = [
        "intercept_unary_unary",
        "intercept_unary_stream",
        "intercept_stream_unary",
        "intercept_stream_stream",
    ]
    for interceptor, method in zip(interceptors, methods, strict=True):
        details = grpc.aio.ClientCallDetails("/m", 5.0, (("x-trace", "1"),), None, None)

        async def continuation(sent, request):
            return sent, request

        sent, request = asyncio.run(getattr(interceptor, method)(continuation, details, "req"))
        assert request == "req" and sent.method == "/m" and sent.timeout == 5.0
        assert list(sent.metadata) == [("x-trace", "1"), (INTERNAL_TOKEN_HEADER, TOKEN)]


def test_the_internal_token_comes_from_its_file_trimmed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(INTERNAL_TOKEN_VAR, "from-the-variable")
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert internal_token(str(path)) == TOKEN  # the file wins over the variable


def test_the_internal_token_comes_from_the_variable_without_a_file(monkeypatch) -> None:
    monkeypatch.setenv(INTERNAL_TOKEN_VAR, f"{TOKEN}\n")
    assert internal_token() == TOKEN
    monkeypatch.delenv(INTERNAL_TOKEN_VAR)
    assert internal_token() == ""  # neither: no token


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("", "is empty"),
        (" \n\t", "is empty"),
        ("two words", "must be printable ASCII without spaces"),
        ("tab\there", "must be printable ASCII without spaces"),
        ("t\u00e9", "must be printable ASCII without spaces"),
        ("bell\x07", "must be printable ASCII without spaces"),
        ("del\x7f", "must be printable ASCII without spaces"),
    ],
)
def test_a_token_that_cannot_travel_stops_the_service(tmp_path, content, why) -> None:
    path = tmp_path / "token"
    path.write_text(content)
    with pytest.raises(SystemExit, match=re.escape(f"the internal token in {path} {why}")):
        internal_token(str(path))


def test_a_token_set_empty_in_the_variable_stops_the_service(monkeypatch) -> None:
    monkeypatch.setenv(INTERNAL_TOKEN_VAR, "")
    with pytest.raises(SystemExit, match=rf"\${INTERNAL_TOKEN_VAR} is empty"):
        internal_token()


def test_every_printable_ascii_byte_may_be_in_a_token(tmp_path) -> None:
    token = "".join(map(chr, range(0x21, 0x7F)))
    path = tmp_path / "token"
    path.write_text(token)
    assert internal_token(str(path)) == token


def test_an_unreadable_token_file_stops_the_service(tmp_path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(SystemExit, match=f"cannot read the internal token file {missing}: No such"):
        internal_token(str(missing))


def test_a_guard_answers_with_the_code_of_its_refusal() -> None:
    """A wrong admin key is PERMISSION_DENIED, not the UNAUTHENTICATED of a missing one."""
    from llmcommon.admin_auth import ADMIN_KEY_HEADER, AdminKeyInterceptor

    admin = "/llmserve.v1.Admin/GetSettings"
    guard = AdminKeyInterceptor("the-admin-key")
    assert call(guard, admin, ((ADMIN_KEY_HEADER, "wrong"),)).startswith("PERMISSION_DENIED")
    assert call(guard, admin, ()).startswith("UNAUTHENTICATED")
    assert call(guard, admin, ((ADMIN_KEY_HEADER, "the-admin-key"),)) == "served"
