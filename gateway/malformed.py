"""Malformed request bytes get INVALID_ARGUMENT, not UNKNOWN; compressed ones are inflated here.

gRPC parses a request before the service sees it; when the bytes are not a valid message (a
client that bypasses protobuf's checks can send a string field holding invalid UTF-8, such as an
encoded lone surrogate), the parse error surfaced as UNKNOWN "Unexpected DecodeError". This
interceptor parses Gateway requests itself and answers INVALID_ARGUMENT with what was wrong, or
RESOURCE_EXHAUSTED when a compressed request inflates past the limit (gateway/inflate.py: the
server hands compressed requests over as they came). Requests of the other services (health,
reflection) are inflated the same way, and refused by gRPC when they cannot be.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from gateway.inflate import TooLarge, inflate

SERVICE_PREFIX = "/llmserve.v1.Gateway/"


class Malformed:
    """Stands in for a request whose bytes did not parse, with the answer to give."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


def tolerant(parse: Callable[[bytes], Any], max_bytes: int) -> Callable[[bytes], Any]:
    def parse_or_mark(data: bytes) -> Any:
        try:
            return parse(inflate(data, max_bytes))
        except TooLarge as err:
            return Malformed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        except DecodeError as err:
            problem = str(err) or "cannot parse"
            message = f"malformed request: {problem} (is every string field valid UTF-8?)"
            return Malformed(grpc.StatusCode.INVALID_ARGUMENT, message)
        except ValueError as err:  # corrupt compressed data
            return Malformed(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {err}")

    return parse_or_mark


def inflating(parse: Callable[[bytes], Any], max_bytes: int) -> Callable[[bytes], Any]:
    return lambda data: parse(inflate(data, max_bytes))


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes  # the largest request, inflated

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        if handler.request_streaming or not handler_call_details.method.startswith(SERVICE_PREFIX):
            parse = inflating(handler.request_deserializer, self.max_bytes)
            return handler._replace(request_deserializer=parse)
        parse = tolerant(handler.request_deserializer, self.max_bytes)
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
            await context.abort(request.code, request.message)
        return await behavior(request, context)

    return checked


def _stream(behavior: Callable[..., AsyncIterator[Any]]):
    async def checked(request, context):
        if isinstance(request, Malformed):
            await context.abort(request.code, request.message)
        async for message in behavior(request, context):
            yield message

    return checked
