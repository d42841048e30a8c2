"""A gateway's core against a scheduler stand-in in this test's event loop: the servicer served
by a real gRPC server on loopback, the core on a channel to it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from gateway.core import GatewayCore
from gateway.settings import GatewaySettings
from gateway.tokenizer_files import load_tokenizer
from llmcommon.v1 import scheduler_pb2_grpc


@contextlib.asynccontextmanager
async def gateway_core(servicer, streams: str, tokenizer=None) -> AsyncIterator[GatewayCore]:
    """A GatewayCore whose scheduler is `servicer`; its requests go on one session stream
    (`streams="session"`) or on a Submit call each ("request")."""
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            settings = GatewaySettings(scheduler_streams=streams)
            yield GatewayCore(settings, tokenizer or load_tokenizer(""), stub, max_context=2048)
    finally:
        await server.stop(0)
