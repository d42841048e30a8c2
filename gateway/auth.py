"""Optional API key on the public API: `authorization: Bearer KEY` or `x-api-key: KEY` metadata.

Health checks and reflection stay open so that probes work without the key.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

PROTECTED_PREFIX = "/llmserve.v1.Gateway/"


def key_from_metadata(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str:
    for name, value in metadata or ():
        text = value.decode() if isinstance(value, bytes) else value
        if name == "x-api-key":
            return text
        if name == "authorization" and text.lower().startswith("bearer "):
            return text[7:].strip()
    return ""


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        self.api_key = api_key.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not details.method.startswith(PROTECTED_PREFIX):
            return await continuation(details)
        given = key_from_metadata(details.invocation_metadata).encode()
        if hmac.compare_digest(given, self.api_key):
            return await continuation(details)
        return _refuse(details, "missing or wrong API key: send `authorization: Bearer KEY`")


def _refuse(details: grpc.HandlerCallDetails, message: str) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    if details.method.endswith("/Generate"):
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)
