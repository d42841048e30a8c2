"""The OpenAI-compatible HTTP API of the gateway (Starlette): completions and chat completions
(whole, or streamed as server-sent events), models, health, tokenize and detokenize, and the
gateway's Prometheus metrics for the operator (`/metrics`, the registry its metrics port serves).

It serves through the same generation path as the gRPC API (gateway/core.py): the same
validation, queue limits, API key and metrics. A client that disconnects cancels its request,
which frees its KV at the next step; `x-request-timeout: SECONDS` is its deadline (gRPC's is the
call's), past which it gets 504.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.api_keys import KeyEntry
from gateway.auth import key_from_metadata, key_refusal
from gateway.choices import merged
from gateway.core import Delta, Finish, GatewayCore
from gateway.generation_errors import GenerationError
from gateway.http_errors import DEADLINE_HEADER, ApiError, from_generation
from gateway.metrics import HTTP_CHAT, HTTP_COMPLETIONS, GatewayMetrics, HttpCall
from gateway.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Sampling,
    TokenizeRequest,
)
from gateway.openai_responses import DONE, Reply, event, logprobs_body, running_usage
from llmcommon.auth import internal_token, internal_token_of
from llmcommon.v1 import scheduler_pb2

T = TypeVar("T")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
HEALTH_TIMEOUT_S = 2.0
# A deadline further than this is none: gRPC's deadlines overflow (and pass at once) from about
# 9.2e9 seconds, its nanoseconds past a 64-bit integer; no request runs for three years.
MAX_DEADLINE_S = 1e8


class ClientGone(Exception):
    """The client disconnected before its answer began (mid-body, too): a cancellation."""


class EventStream(StreamingResponse):
    """Server-sent events whose request is cancelled and whose call is counted however the
    response ends: the client may leave before its body begins, and a body that never began
    never runs its own cleanup."""

    def __init__(self, chunks: AsyncGenerator[bytes, None], events: AsyncGenerator, call: HttpCall):
        super().__init__(chunks, media_type="text/event-stream", headers=SSE_HEADERS)
        self.chunks, self.events, self.call = chunks, events, call

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.chunks.aclose()
            await self.events.aclose()
            self.call.end("CANCELLED")  # a no-op once the stream has ended


class HttpApi:
    def __init__(
        self,
        core: GatewayCore,
        metrics: GatewayMetrics | None = None,
        max_body_bytes: int = 1 << 20,
        serving: Callable[[], bool] = lambda: True,  # False once the gateway drains
    ) -> None:
        self.core = core
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.serving = serving
        self.started = int(time.time())
        self.operator_token: str | None = None  # the stack's internal token, read once

    def app(self) -> Starlette:
        routes = [
            Route(HTTP_CHAT, self.chat_completions, methods=["POST"]),
            Route(HTTP_COMPLETIONS, self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/metrics", self.metrics_page, methods=["GET"]),
        ]
        handlers = {
            HTTPException: _route_error,
            ApiError: _api_error,
            ClientGone: _client_gone,
            Exception: _server_error,
        }
        app = Starlette(routes=routes, exception_handlers=handlers)
        # a path with a trailing slash is no route (404 in OpenAI's shape), not a redirect whose
        # Location echoes the client's Host header, answered before the API key is checked
        app.router.redirect_slashes = False
        return app

    # ---- generation ----------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, HTTP_CHAT, ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, HTTP_COMPLETIONS, CompletionRequest)

    async def _generate(self, request: Request, path: str, kind: type[Sampling]) -> Response:
        call = self.metrics.http_call(path) if self.metrics else HttpCall(None, path)
        try:
            key = self._authorize(request)
            body = kind.parse(await self._body(request))
            self._check_model(body.model)
            job = body.generate_input()
            body.check_vocabulary(self.core.tokenizer.vocab_size)
            usage_chunks = body.stream and body.include_usage
            reply = Reply(
                path == HTTP_CHAT,
                self.core.model,
                usage_chunks,
                body.continuous_usage,
                tools=body.tool_plan(),
            )
            remaining = _time_remaining(request)
            jobs = body.choices(job)
            claim = self.core.claim(len(jobs))
            streams = [
                self.core.generate(job, remaining, f"{reply.id}-{i}" if i else reply.id, key, claim)
                for i, job in enumerate(jobs)
            ]
            if body.stream:  # refusals come before the first event: they get their status
                events = merged(streams, claim.close)
                first = await _unless_gone(request, anext(events))
                chunks = self._stream(reply, len(streams), first, events, call)
                return EventStream(chunks, events, call)
            results = await _unless_gone(request, _collect_all(streams, claim.close))
        except GenerationError as err:
            return _failed(call, from_generation(err))
        except ApiError as err:
            return _failed(call, err)
        except ClientGone:
            call.end("CANCELLED")
            return Response(status_code=499)
        except BaseException as err:  # a failure of the gateway (500), or its shutdown
            call.end("CANCELLED" if isinstance(err, asyncio.CancelledError) else "INTERNAL")
            raise
        call.end("OK")
        return JSONResponse(
            reply.whole([(t, f, self._logprobs(reply, ids, lps)) for t, f, ids, lps in results])
        )

    def _logprobs(self, reply: Reply, ids: list[int], logprobs: list, offset: int = 0):
        tokenizer = self.core.tokenizer
        return logprobs_body(
            reply.chat,
            ids,
            logprobs,
            lambda t: tokenizer.decode([t]),
            tokenizer.token_bytes,
            offset,
        )

    def _held_logprobs(self, reply: Reply, held: tuple[list, list, int] | None):
        """The logprobs body of tokens (ids, logprobs, text offset); None without logprobs."""
        if held is None or not held[1]:
            return None
        return self._logprobs(reply, *held)

    async def _stream(
        self,
        reply: Reply,
        n: int,
        first: tuple[int, Delta | Finish],
        events: AsyncGenerator,
        call: HttpCall,
    ) -> AsyncGenerator[bytes, None]:
        """The chunks of n choices, each with its index, as their tokens come."""
        code = "CANCELLED"  # until it ends otherwise: the client left
        prompt = _prompt_tokens(first[1])
        counts = [0] * n  # each choice's tokens so far, for continuous usage
        held: dict[int, tuple[list, list, int]] = {}  # tokens a tool stream held back, by choice

        def so_far(index: int) -> dict:
            return running_usage(prompt, counts[index])

        calls = [reply.tools.stream() for _ in range(n)] if reply.tools else None
        try:
            async with aclosing(events):
                if reply.chat:  # a forced call's answer has no content: null, as OpenAI's
                    opening = {"content": None} if reply.tools and reply.tools.forced else None
                    for index in range(n):
                        yield reply.chunk(
                            None if opening else "",
                            role=True,
                            index=index,
                            so_far=so_far(index),
                            delta=opening,
                        )
                (index, item), offsets, finishes = first, [0] * n, {}
                while True:
                    if isinstance(item, Finish):
                        finishes[index] = item
                        called = False
                        if calls is not None:  # what the choice's tool stream held back
                            logprobs = self._held_logprobs(reply, held.pop(index, None))
                            for delta in calls[index].end():
                                yield reply.chunk(None, logprobs=logprobs, index=index, delta=delta)
                                logprobs = None
                            if logprobs is not None:  # nothing more to say but their logprobs
                                yield reply.chunk(None, logprobs=logprobs, index=index, delta={})
                            called = calls[index].called
                        usage = so_far(index)
                        yield reply.chunk(None, item, index=index, so_far=usage, called=called)
                        if len(finishes) == n:
                            break
                    else:
                        counts[index] += len(item.token_ids)
                    if isinstance(item, Delta) and (item.text or item.logprobs):
                        at = offsets[index]
                        logprobs = self._logprobs(reply, item.token_ids, item.logprobs, at)
                        usage = so_far(index)
                        if calls is None:
                            yield reply.chunk(
                                item.text, logprobs=logprobs, index=index, so_far=usage
                            )
                        else:  # tool calls' deltas: the logprobs go with the first of them,
                            # with those of the tokens the tool stream held back before them
                            ids, lps, start = held.pop(index, ([], [], at))
                            ids, lps = ids + list(item.token_ids), lps + list(item.logprobs)
                            logprobs = self._held_logprobs(reply, (ids, lps, start))
                            for delta in calls[index].feed(item.text):
                                yield reply.chunk(
                                    None, logprobs=logprobs, index=index, so_far=usage, delta=delta
                                )
                                logprobs = None
                            if logprobs is not None:  # held back: they go with a later delta
                                held[index] = (ids, lps, start)
                        offsets[index] += len(item.text)
                    index, item = await anext(events)
                if reply.include_usage:
                    yield reply.usage_chunk([finishes[i] for i in range(n)])
            code = "OK"
        except GenerationError as err:  # after the first event: the status is sent already
            failure = from_generation(err)
            code = failure.code.name
            yield event(failure.body())
        finally:
            call.end(code)
        yield DONE

    # ---- models, health, tokens ----------------------------------------------------------

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        """200 while the gateway serves and its scheduler has a worker; else 503. Open without
        the API key, as gRPC health is, so that probes need no secret."""
        if not self.serving():
            raise ApiError(grpc.StatusCode.UNAVAILABLE, "the gateway is stopping")
        if self.core.refusal is not None:
            raise ApiError(grpc.StatusCode.UNAVAILABLE, self.core.refusal)
        try:
            status = await self.core.scheduler.Status(
                scheduler_pb2.StatusRequest(), timeout=HEALTH_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as err:
            message = f"the scheduler is unavailable ({err.code().name}: {err.details()})"
            raise ApiError(grpc.StatusCode.UNAVAILABLE, message) from None
        if status.max_context == 0:
            raise ApiError(grpc.StatusCode.UNAVAILABLE, "the scheduler has no healthy worker")
        return Response(status_code=200)

    async def tokenize(self, request: Request) -> Response:
        """The token ids a completion (`prompt`) or chat completion (`messages`, rendered with
        the chat template, with the tools it renders) of this text would start from: `count` is
        its usage.prompt_tokens."""
        self._authorize(request)
        body = TokenizeRequest.parse(await self._body(request))
        self._check_model(body.model)
        try:
            _, ids = await self.core.prepare(body.generate_input())
        except ValueError as err:  # named as the generation path names it
            param = getattr(err, "param", None)
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(err), param=param) from None
        return JSONResponse(
            {"count": len(ids), "max_model_len": self.core.max_context, "tokens": ids}
        )

    async def detokenize(self, request: Request) -> Response:
        self._authorize(request)
        body = DetokenizeRequest.parse(await self._body(request))
        self._check_model(body.model)
        vocab = self.core.tokenizer.vocab_size
        outside = [t for t in body.tokens if not 0 <= t < vocab]
        if outside:
            message = f"token id {outside[0]} is outside the vocabulary 0..{vocab - 1}"
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param="tokens")
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(self.core.pool, self.core.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    async def metrics_page(self, request: Request) -> Response:
        """The gateway's Prometheus metrics (the registry of its --metrics-port), for the
        operator only: they are about every client (docs/observability.md)."""
        self._authorize_operator(request)
        if self.metrics is None:
            raise ApiError(grpc.StatusCode.NOT_FOUND, "this gateway keeps no metrics")
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- the checks every route shares -----------------------------------------------------

    def _authorize_operator(self, request: Request) -> None:
        """The stack's internal token (the operator's credential), as `Authorization: Bearer
        TOKEN` (Prometheus' scrape `authorization`) or its own header. Without one the stack has
        no operator apart from its clients: open when it has no API key either (every port is
        open then), else refused, for an API key is a client's."""
        if self.operator_token is None:
            self.operator_token = internal_token(self.core.settings.internal_token_file)
        if not self.operator_token:
            if self.core.keys().required:
                message = (
                    "/metrics on the HTTP port needs the stack's internal token, and this stack "
                    "has none: scrape the gateway's --metrics-port"
                )
                raise ApiError(grpc.StatusCode.PERMISSION_DENIED, message, status=403)
            return
        headers = tuple(request.headers.items())
        given = (internal_token_of(headers) or key_from_metadata(headers)).encode()
        if not hmac.compare_digest(given, self.operator_token.encode()):
            message = (
                "/metrics needs the stack's internal token: send `authorization: Bearer TOKEN`"
            )
            raise ApiError(grpc.StatusCode.UNAUTHENTICATED, message)

    def _authorize(self, request: Request) -> KeyEntry:
        """The entry of the key sent as `Authorization: Bearer KEY` (or `x-api-key: KEY`), as
        on gRPC; 401 when it is none of the keys in force."""
        headers = tuple(request.headers.items())
        entry = self.core.keys().entry(key_from_metadata(headers))
        if entry is None:
            raise ApiError(grpc.StatusCode.UNAUTHENTICATED, key_refusal(headers))
        return entry

    async def _body(self, request: Request) -> bytes:
        """The body, refused (413) past --max-request-bytes before more of it is read."""
        limit = self.max_body_bytes
        too_large = ApiError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the request body is larger than {limit} bytes (the gateway's --max-request-bytes)",
            status=413,
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:  # it left mid-body (or was closed: --http-body-timeout)
            raise ClientGone from None
        return b"".join(chunks)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.core.model:
            raise ApiError(
                grpc.StatusCode.NOT_FOUND,
                f"the model `{name}` does not exist: this server serves `{self.core.model}`",
                param="model",
            )

    def _model_card(self) -> dict:
        return {
            "id": self.core.model,
            "object": "model",
            "created": self.started,
            "owned_by": "llmserve",
            "max_model_len": self.core.max_context,
        }


def _time_remaining(request: Request) -> Callable[[], float | None]:
    """Seconds left before the request's deadline (its x-request-timeout header); None: none."""
    header = request.headers.get(DEADLINE_HEADER)
    if header is None:
        return lambda: None
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ApiError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{DEADLINE_HEADER} is {header!r}; it must be a positive number of seconds",
            param=DEADLINE_HEADER,
        )
    if seconds > MAX_DEADLINE_S:
        return lambda: None
    deadline = time.monotonic() + seconds
    return lambda: deadline - time.monotonic()


def _prompt_tokens(item: Delta | Finish) -> int:
    """The request's prompt tokens, from its first event."""
    return item.usage.prompt_tokens if isinstance(item, Finish) else item.prompt_tokens


async def _collect(events: AsyncIterator[Delta | Finish]) -> tuple[str, Finish, list, list]:
    """The whole text, the finish, the token ids and their logprobs (when asked)."""
    text, ids, logprobs = [], [], []
    async with aclosing(events):
        async for item in events:
            if isinstance(item, Finish):
                return "".join(text), item, ids, logprobs
            text.append(item.text)
            ids += item.token_ids
            logprobs += item.logprobs
    raise GenerationError(grpc.StatusCode.INTERNAL, "the generation ended without a result")


async def _collect_all(
    streams: list[AsyncIterator[Delta | Finish]], closed: Callable[[], None]
) -> list[tuple]:
    """Each stream collected, concurrently; the first failure cancels the others. `closed`
    runs once they have all ended (the choices' unused queue places go back)."""
    tasks = [asyncio.ensure_future(_collect(events)) for events in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a no-op once it is done
        await asyncio.wait(tasks)  # their cleanup (the scheduler's calls cancelled) runs now
        closed()
        for task in tasks:
            if not task.cancelled():
                task.exception()  # retrieved: a second failure is not logged as lost


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; cancelled (its request with it) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # a no-op once it is done
    if task not in done:
        await asyncio.wait((task,))  # its cleanup (the scheduler's call cancelled) runs now
        raise ClientGone
    error = task.exception()
    if error is None:
        return task.result()
    task = None  # it holds the error, whose traceback holds this frame: no cycle
    try:
        raise error
    finally:
        error = None


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _failed(call: HttpCall, err: ApiError) -> Response:
    call.end(err.code.name)
    return err.response()


async def _api_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, ApiError)
    return err.response()


async def _client_gone(request: Request, err: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it


async def _route_error(request: Request, err: Exception) -> Response:
    """The router's 404 and 405, in OpenAI's shape."""
    assert isinstance(err, HTTPException)
    where = f"{request.method} {request.url.path}"
    if err.status_code == 405:
        code, message = grpc.StatusCode.UNIMPLEMENTED, f"{where}: method not allowed"
    elif err.status_code == 404:
        code, message = grpc.StatusCode.NOT_FOUND, f"{where}: no such route"
    else:
        code, message = grpc.StatusCode.UNKNOWN, f"{where}: {err.detail}"
    return ApiError(code, message, status=err.status_code).response()


async def _server_error(request: Request, err: Exception) -> Response:
    """A failure of the gateway itself (its traceback is logged): 500, in OpenAI's shape."""
    message = f"the gateway failed ({type(err).__name__}); see its log"
    return ApiError(grpc.StatusCode.INTERNAL, message).response()
