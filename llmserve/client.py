"""Thin clients of the public Gateway API and the scheduler's Status, used by the CLI."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from llmserve.auth import token_metadata
from llmserve.server import CHANNEL_OPTIONS
from llmserve.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

FINISH_NAMES = {
    common_pb2.FINISH_REASON_UNSPECIFIED: "unspecified",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
    common_pb2.FINISH_REASON_ERROR: "error",
}


def make_request(
    prompt: str | None = None,
    messages: list[tuple[str, str]] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    stop: list[str] | None = None,
    ignore_eos: bool = False,
    request_id: str = "",
) -> gateway_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        top_p=top_p,
        top_k=top_k,
        stop=stop or [],
        ignore_eos=ignore_eos,
    )
    request = gateway_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
    if messages is not None:
        request.chat.messages.extend(
            gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages
        )
    else:
        request.prompt = prompt or ""
    return request


def channel(target: str, tls_ca: str = "") -> grpc.Channel:
    """A channel to `target`; TLS when a CA certificate file is given."""
    if tls_ca:
        with open(tls_ca, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        return grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)


def stream(
    target: str,
    request: gateway_pb2.GenerateRequest,
    timeout: float | None = None,
    api_key: str = "",
    tls_ca: str = "",
) -> Iterator[gateway_pb2.GenerateResponse]:
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with channel(target, tls_ca) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        yield from stub.Generate(request, timeout=timeout, metadata=metadata)


def status(target: str, timeout: float = 5.0, token: str = "") -> scheduler_pb2.StatusReply:
    """The scheduler's Status; `token` is the internal token, when the stack has one."""
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        request = scheduler_pb2.StatusRequest()
        return stub.Status(request, timeout=timeout, metadata=token_metadata(token))


def usage_dict(usage: common_pb2.Usage) -> dict[str, float | int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "queue_time_s": round(usage.queue_time_s, 4),
        "time_to_first_token_s": round(usage.time_to_first_token_s, 4),
        "total_time_s": round(usage.total_time_s, 4),
        "preemptions": usage.preemptions,
    }
