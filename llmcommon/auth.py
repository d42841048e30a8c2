"""A shared secret on gRPC calls: the server side checks it, the client side sends it.

The internal token authenticates the services to one another (gateway -> scheduler, scheduler ->
workers, worker -> scheduler): one secret, a file every service reads at start (a Kubernetes
Secret mounted into every pod), sent as `x-llmserve-internal-token` metadata. The gateway's public
API key is checked by the same interceptor with its own metadata names (gateway/auth.py).
Health checks and reflection stay open so that probes work without any secret.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc

Metadata = tuple[tuple[str, str | bytes], ...] | None

INTERNAL_TOKEN_HEADER = "x-llmserve-internal-token"
INTERNAL_TOKEN_VAR = "LLMSERVE_INTERNAL_TOKEN"
INTERNAL_TOKEN_HELP = (
    "a file holding the token that every internal call carries; gateway, scheduler and workers "
    f"share it (also ${INTERNAL_TOKEN_VAR}; '' and the variable unset = no token)"
)
INTERNAL_REFUSAL = (
    "missing or wrong internal token: gateway, scheduler and workers must share one "
    f"--internal-token-file (or ${INTERNAL_TOKEN_VAR})"
)


def read_secret_file(path: str, what: str) -> bytes:
    """A secret's file content, stripped (empty when the file is). An unreadable file is
    SystemExit with the reason: a secret that was configured is never silently off."""
    try:
        return Path(path).read_bytes().strip()
    except OSError as err:
        raise SystemExit(f"cannot read the {what} file {path}: {err.strerror}") from None


def internal_token(path: str = "") -> str:
    """The internal token: the content of `path`, else $LLMSERVE_INTERNAL_TOKEN; "" when neither
    is set. Set but empty, unreadable or not printable ASCII (it travels as gRPC metadata) is
    SystemExit with the reason: a configured token is never silently off."""
    if path:
        source, raw = path, read_secret_file(path, "internal token")
    elif INTERNAL_TOKEN_VAR in os.environ:
        source, raw = f"${INTERNAL_TOKEN_VAR}", os.environb[INTERNAL_TOKEN_VAR.encode()]
    else:
        return ""
    return metadata_secret(raw, "internal token", source)


def metadata_secret(raw: bytes, what: str, source: str) -> str:
    """A secret that travels as gRPC metadata, from its file or variable: empty or not
    printable ASCII is SystemExit with the reason (a configured secret is never silently off)."""
    secret = raw.strip()
    if not secret:
        raise SystemExit(f"the {what} in {source} is empty")
    if not all(0x21 <= byte <= 0x7E for byte in secret):
        raise SystemExit(f"the {what} in {source} must be printable ASCII without spaces")
    return secret.decode()


def metadata_value(metadata: Metadata, header: str) -> str:
    """The value of `header` in a call's metadata ("" when absent)."""
    for name, value in metadata or ():
        if name == header:
            return value.decode() if isinstance(value, bytes) else value
    return ""


def internal_token_of(metadata: Metadata) -> str:
    return metadata_value(metadata, INTERNAL_TOKEN_HEADER)


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the internal token (none without one)."""
    return ((INTERNAL_TOKEN_HEADER, token),) if token else ()


Refusal = tuple[grpc.StatusCode, str]  # the status a refused call is answered with, and why


class ServiceGuard(grpc.aio.ServerInterceptor):
    """A call of `services` goes on only where `refusal_of` its metadata is None, else it is
    answered with that refusal (its request never parsed). Other services (health, reflection)
    stay open."""

    services: frozenset[str]

    def refusal_of(self, metadata: Metadata) -> Refusal | None:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.split("/")[1] not in self.services:
            return handler
        why = self.refusal_of(details.invocation_metadata)
        return handler if why is None else refused(handler, why[1], why[0])


class TokenInterceptor(ServiceGuard):
    """Every call of `services` must carry `token` (found by `token_of`), compared in constant
    time over the whole token, else UNAUTHENTICATED with `refusal`."""

    def __init__(
        self,
        services: Iterable[str],
        token: str,
        token_of: Callable[[Metadata], str] = internal_token_of,
        refusal: str = INTERNAL_REFUSAL,
    ) -> None:
        self.services = frozenset(services)
        self.token = token.encode()
        self.token_of = token_of
        self.refusal = refusal

    def refusal_of(self, metadata: Metadata) -> Refusal | None:
        if hmac.compare_digest(self.token_of(metadata).encode(), self.token):
            return None
        return grpc.StatusCode.UNAUTHENTICATED, self.refusal


def refused(
    handler: grpc.RpcMethodHandler,
    message: str,
    code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers `code` (the request is never
    parsed)."""

    async def unary(request, context):
        await context.abort(code, message)

    async def stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(stream if handler.response_streaming else unary)


class _SendsToken:
    """Adds the internal token to a call's metadata (grpc's call credentials would need a
    secure channel: on an insecure one gRPC refuses to send them)."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def _intercept(self, continuation, details, request):
        metadata = grpc.aio.Metadata(*(details.metadata or ()), (INTERNAL_TOKEN_HEADER, self.token))
        return await continuation(details._replace(metadata=metadata), request)


class _UnaryUnary(_SendsToken, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _SendsToken._intercept


class _UnaryStream(_SendsToken, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _SendsToken._intercept


class _StreamUnary(_SendsToken, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _SendsToken._intercept


class _StreamStream(_SendsToken, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _SendsToken._intercept


def token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that send the internal token on every call of a channel: one per
    kind of call, since an aio channel files each interceptor under one kind only."""
    if not token:
        return []
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
