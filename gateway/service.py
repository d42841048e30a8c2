"""The public gRPC Gateway service: protobuf in, the gateway's generation path, protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from gateway.core import Delta, Finish, GatewayCore, GenerateInput, GenerationError
from gateway.usage import Tally
from llmserve.v1 import gateway_pb2, gateway_pb2_grpc

__all__ = ["GatewayService", "Tally", "generate_input"]

STATUS_TIMEOUT_S = 10.0  # a Status call without a deadline waits for the scheduler this long


def generate_input(request: gateway_pb2.GenerateRequest) -> GenerateInput:
    """The request as the core takes it; chat messages stay protobuf until their count and size
    are checked."""
    s = request.sampling
    kind = request.WhichOneof("input")
    return GenerateInput(
        prompt=request.prompt if kind == "prompt" else None,
        messages=request.chat.messages if kind == "chat" else None,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        seed=s.seed if s.HasField("seed") else None,
        stop=s.stop,
        ignore_eos=s.ignore_eos,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None,
        stop_token_ids=s.stop_token_ids,
        min_tokens=s.min_tokens,
        logit_bias=dict(s.logit_bias),
        logprobs=s.logprobs if s.HasField("logprobs") else None,
    )


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def Generate(self, request, context):
        async for message in self._generate(request, context):
            yield message

    async def GenerateUnary(self, request, context):
        text, ids, logprobs = [], [], []
        final = None
        async for message in self._generate(request, context):
            if message.HasField("delta"):
                text.append(message.delta.text)
                ids.extend(message.delta.token_ids)
                logprobs.extend(message.delta.logprobs)
            else:
                final = message.final
        if final is None:  # refused: the context holds the status
            return None
        return gateway_pb2.GenerateResult(
            request_id=final.request_id,
            text="".join(text),
            token_ids=ids,
            finish_reason=final.finish_reason,
            usage=final.usage,
            error=final.error,
            logprobs=logprobs,
        )

    async def Status(self, request, context):
        """The scheduler's Status, passed on: `llmserve status` needs only the gateway."""
        try:
            timeout = context.time_remaining() or STATUS_TIMEOUT_S
            return await self.core.scheduler.Status(request, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            await context.abort(err.code(), f"the scheduler's status: {err.details()}")

    async def _generate(self, request, context) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        # closed here, not when collected: a client that left frees its KV at the next step
        async with aclosing(
            self.core.generate(generate_input(request), context.time_remaining)
        ) as events:
            try:
                async for event in events:
                    yield _message(request, event)
            except GenerationError as err:
                _refuse(context, err.code, err.message)


def _message(request, event: Delta | Finish) -> gateway_pb2.GenerateResponse:
    if isinstance(event, Delta):
        delta = gateway_pb2.TokenDelta(
            text=event.text, token_ids=event.token_ids, logprobs=event.logprobs
        )
        return gateway_pb2.GenerateResponse(delta=delta)
    final = gateway_pb2.Final(
        request_id=request.request_id or event.request_id,  # the client's id, if it gave one
        finish_reason=event.reason,
        usage=event.usage,
        error=event.error,
    )
    return gateway_pb2.GenerateResponse(final=final)


def _refuse(context, code: grpc.StatusCode, message: str) -> None:
    """End the call with `code` without raising. `context.abort` raises an exception that grpc
    keeps on the call's state: a reference cycle through every frame of the handler, which kept
    a refused request (a 0.8 MB chat parses into 100k messages) until a full garbage collection."""
    context.set_code(code)
    context.set_details(message)
