"""A message that cannot be parsed is the peer's error, answered INVALID_ARGUMENT saying so.

gRPC's own answer to an undecodable request is UNKNOWN ("Unexpected DecodeError") with a
traceback in the server's log, as if the server had failed; and an undecodable message on a
request stream ends the handler's `async for` with an exception that a reader task swallows
(the stream then ended OK, nothing said). `ReadableRequests` covers the calls with one request,
on every service's server (llmcommon.server.Server); a stream's reader says
`unreadable_message(err)` itself (worker Steps, scheduler Session). The gateway's subclass also
inflates compressed requests (gateway/malformed.py)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc

Parse = Callable[[bytes], Any]


def unreadable_message(err: Exception) -> str:
    return f"a message on this call could not be read ({type(err).__name__}: {err})"


class Unreadable:
    """Stands for a request that did not parse, with the answer to give; the handler never
    sees it."""

    __slots__ = ("code", "message")

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


class ReadableRequests(grpc.aio.ServerInterceptor):
    """Every call with one request (any service's): a request that does not parse is
    answered with `refusal(err)` (INVALID_ARGUMENT), its handler never called. Subclasses
    change how bytes are read (`read`) and what a failure is answered."""

    def read(self, parse: Parse, data: bytes) -> Any:
        return parse(data)

    def refusal(self, err: Exception) -> Unreadable:
        return Unreadable(grpc.StatusCode.INVALID_ARGUMENT, unreadable_message(err))

    def tolerant(self, parse: Parse) -> Parse:
        def read(data: bytes) -> Any:
            try:
                return self.read(parse, data)
            except Exception as err:  # noqa: BLE001 - any failure to read is the peer's
                return self.refusal(err)

        return read

    def reading(self, parse: Parse) -> Parse:
        """How a stream's requests are read (`read`, failures raised: its reader says so)."""
        return lambda data: self.read(parse, data)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        if handler.request_streaming:
            return handler._replace(request_deserializer=self.reading(parse))
        if handler.unary_unary is not None:
            checked = {"unary_unary": _unary(handler.unary_unary)}
        elif inspect.isasyncgenfunction(handler.unary_stream):
            checked = {"unary_stream": _stream(handler.unary_stream)}
        else:  # a handler that writes with context.write: read as it was
            return handler._replace(request_deserializer=self.reading(parse))
        return handler._replace(request_deserializer=self.tolerant(parse), **checked)


def _unary(behaviour: Callable[..., Awaitable[Any]]):
    async def checked(request, context):
        if isinstance(request, Unreadable):
            await context.abort(request.code, request.message)
        return await behaviour(request, context)

    return checked


def _stream(behaviour: Callable[..., Any]):
    async def checked(request, context):
        if isinstance(request, Unreadable):
            await context.abort(request.code, request.message)
        async with aclosing(behaviour(request, context)) as responses:  # its finally at once
            async for response in responses:
                yield response

    return checked
