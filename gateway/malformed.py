"""Malformed request bytes get INVALID_ARGUMENT, not UNKNOWN.

gRPC parses a request before the service sees it; when the bytes are not a valid message (a
client that bypasses protobuf's checks can send a string field holding invalid UTF-8, such as an
encoded lone surrogate), the parse error surfaced as UNKNOWN "Unexpected DecodeError". This
interceptor parses Gateway requests itself and answers INVALID_ARGUMENT with what was wrong.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

SERVICE_PREFIX = "/llmserve.v1.Gateway/"


class Malformed:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, error: str) -> None:
        self.error = error


def tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_mark(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as err:
            return Malformed(str(err) or "cannot parse")

    return parse_or_mark


def _message(request: Malformed) -> str:
    return f"malformed request: {request.error} (is every string field valid UTF-8?)"


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or handler.request_deserializer is None
            or handler.request_streaming
            or not handler_call_details.method.startswith(SERVICE_PREFIX)
        ):
            return handler
        parse = tolerant(handler.request_deserializer)
        if handler.unary_stream is not None:
            return handler._replace(
                request_deserializer=parse, unary_stream=_stream(handler.unary_stream)
            )
        if handler.unary_unary is not None:
            return handler._replace(
                request_deserializer=parse, unary_unary=_unary(handler.unary_unary)
            )
        return handler


def _unary(behavior: Callable[..., Awaitable[Any]]):
    async def checked(request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request))
        return await behavior(request, context)

    return checked


def _stream(behavior: Callable[..., AsyncIterator[Any]]):
    async def checked(request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request))
        async for message in behavior(request, context):
            yield message

    return checked
