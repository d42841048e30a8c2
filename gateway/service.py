"""The public gRPC Gateway service: protobuf in, the gateway's generation path, protobuf out."""

from __future__ import annotations

import hmac
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

import grpc

from gateway.admin import forwarded_metadata
from gateway.auth import API_KEY_REFUSAL, key_from_metadata
from gateway.choices import choice_inputs, choices_problem, merged
from gateway.core import Delta, Finish, GatewayCore, GenerateInput
from gateway.generation_errors import GenerationError
from gateway.usage import Tally
from llmcommon.admin_auth import admin_key, admin_key_of
from llmcommon.auth import internal_token, internal_token_of
from llmcommon.errors import bounded
from llmcommon.protocol import CELL_KEY, ROUTE_KEY, SESSION_KEY
from llmcommon.sampling_wire import params_of
from llmcommon.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2

__all__ = ["GatewayService", "Tally", "generate_input"]

STATUS_TIMEOUT_S = 10.0  # a Status call without a deadline waits for the scheduler this long
# a worker's figures that move with prefix-cache hits (an ordinary client's Status omits them)
CACHE_FIGURES = ("cached_blocks", "evictable_blocks", "evictions", "prompt_tokens", "hit_tokens")


def generate_input(request: gateway_pb2.GenerateRequest) -> GenerateInput:
    """The request as the core takes it; chat messages stay protobuf until their count and size
    are checked."""
    kind = request.WhichOneof("input")
    return GenerateInput(
        prompt=request.prompt if kind == "prompt" else None,
        messages=request.chat.messages if kind == "chat" else None,
        sampling=params_of(request.sampling),  # the one conversion from the wire
        cache_salt=request.cache_salt,
        priority=request.priority if request.HasField("priority") else None,
        slo_class=request.slo_class,
    )


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self.operator_keys: tuple[str, str] | None = None  # internal token, admin key ("" = none)

    async def Generate(self, request, context):
        async for message in self._generate(request, context):
            yield message

    async def GenerateUnary(self, request, context):
        texts: dict[int, list[str]] = defaultdict(list)
        choices: dict[int, gateway_pb2.Choice] = defaultdict(gateway_pb2.Choice)
        finals: dict[int, gateway_pb2.Final] = {}
        async for message in self._generate(request, context):
            if message.HasField("delta"):
                delta, choice = message.delta, choices[message.delta.index]
                texts[delta.index].append(delta.text)
                choice.token_ids.extend(delta.token_ids)
                choice.logprobs.extend(delta.logprobs)
            else:
                finals[message.final.index] = message.final
        if not finals or len(finals) < _n(request):  # refused: the context holds the status
            return None
        for index, final in finals.items():
            choice = choices[index]
            choice.index, choice.text = index, "".join(texts[index])
            choice.finish_reason, choice.error = final.finish_reason, final.error
            choice.usage.CopyFrom(final.usage)
        ordered = [choices[i] for i in range(len(finals))]
        first = ordered[0]
        return gateway_pb2.GenerateResult(
            request_id=finals[0].request_id,
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            usage=total_usage([c.usage for c in ordered]),
            error=first.error,
            logprobs=first.logprobs,
            choices=ordered,
        )

    async def Status(self, request, context):
        """The scheduler's Status, passed on: `llmserve status` needs only the gateway. An
        ordinary client (the API key only) gets it without the prefix-cache figures, which
        would tell it whether another client's prompt starts like its own; the operator (the
        call carries the stack's internal token or the admin key) gets them all."""
        cells = self.core.cells
        try:
            timeout = context.time_remaining() or STATUS_TIMEOUT_S
            metadata = forwarded_metadata(context) if request.explain else ()  # its admin key
            reply = await self.core.scheduler.Status(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as err:
            if cells is None or request.explain:
                await context.abort(err.code(), f"the scheduler's status: {err.details()}")
            reply = scheduler_pb2.StatusReply()  # no cell answers: the cells' table says so
        if cells is not None:  # a live cell's reply, and every cell's figures
            reply.cells.extend(await cells.statuses())
        if not self._operator(context.invocation_metadata()):
            withhold_cache_figures(reply)
        return reply

    def _operator(self, metadata) -> bool:
        """Does the call carry the internal token or the admin key (each in its own header)?"""
        if self.operator_keys is None:  # read once
            settings = self.core.settings
            self.operator_keys = (
                internal_token(settings.internal_token_file),
                admin_key(settings.admin_key_file),
            )
        given = (internal_token_of(metadata), admin_key_of(metadata))
        return any(
            key and hmac.compare_digest(sent.encode(), key.encode())
            for sent, key in zip(given, self.operator_keys, strict=True)
        )

    async def _generate(self, request, context) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        problem = choices_problem(request.n if request.HasField("n") else None)
        if problem is not None:
            _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
            return
        key = self.core.keys().entry(key_from_metadata(context.invocation_metadata()))
        if key is None:  # the keys were reloaded since the interceptor let it in
            _refuse(context, grpc.StatusCode.UNAUTHENTICATED, API_KEY_REFUSAL)
            return
        rid = uuid.uuid4().hex
        session = dict(context.invocation_metadata() or ()).get(SESSION_KEY, "")
        job = replace(generate_input(request), session=str(session))
        jobs = choice_inputs(job, _n(request))
        claim = self.core.claim(len(jobs))
        streams = [
            self.core.generate(job, context.time_remaining, f"{rid}-{i}" if i else rid, key, claim)
            for i, job in enumerate(jobs)
        ]
        # closed here, not when collected: a client that left frees its KV at the next step
        routes: dict[int, tuple[str, str]] = {}
        async with aclosing(merged(streams, claim.close)) as events:
            try:
                async for index, event in events:
                    if isinstance(event, Finish) and event.cell:
                        routes[index] = (event.cell, event.route)
                    yield _message(request, index, event)
            except GenerationError as err:
                _refuse(context, err.code, err.message)
        if routes:
            ordered = [routes[i] for i in sorted(routes)]
            context.set_trailing_metadata(
                (
                    (CELL_KEY, ",".join(cell for cell, _ in ordered)),
                    (ROUTE_KEY, ",".join(why for _, why in ordered)),
                )
            )


def withhold_cache_figures(reply: scheduler_pb2.StatusReply) -> None:
    """Clear every figure that moves with prefix-cache hits, and say so."""
    for kv in reply.workers:
        for name in CACHE_FIGURES:
            kv.ClearField(name)
    for name in ("prompt_tokens", "hit_tokens", "evictions"):
        reply.ClearField(name)
    for cell in reply.cells:
        cell.ClearField("prompt_tokens")
        cell.ClearField("hit_tokens")
    reply.cache_figures_withheld = True


def _n(request: gateway_pb2.GenerateRequest) -> int:
    return request.n if request.HasField("n") else 1


def total_usage(usages: list[common_pb2.Usage]) -> common_pb2.Usage:
    """The usage of several choices of one prompt, as OpenAI counts it: the prompt once, the
    completions summed (the first choice's timings)."""
    total = common_pb2.Usage()
    total.CopyFrom(usages[0])
    total.completion_tokens = sum(u.completion_tokens for u in usages)
    total.preemptions = sum(u.preemptions for u in usages)
    return total


def _message(request, index: int, event: Delta | Finish) -> gateway_pb2.GenerateResponse:
    if isinstance(event, Delta):
        delta = gateway_pb2.TokenDelta(
            text=event.text, token_ids=event.token_ids, logprobs=event.logprobs, index=index
        )
        return gateway_pb2.GenerateResponse(delta=delta)
    final = gateway_pb2.Final(
        request_id=request.request_id or event.request_id,  # the client's id, if it gave one
        finish_reason=event.reason,
        usage=event.usage,
        error=event.error,
        index=index,
    )
    return gateway_pb2.GenerateResponse(final=final)


def _refuse(context, code: grpc.StatusCode, message: str) -> None:
    """End the call with `code` without raising. `context.abort` raises an exception that grpc
    keeps on the call's state: a reference cycle through every frame of the handler, which kept
    a refused request (a 0.8 MB chat parses into 100k messages) until a full garbage collection."""
    context.set_code(code)
    context.set_details(bounded(message))
