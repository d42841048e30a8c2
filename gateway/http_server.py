"""uvicorn in the gateway's own event loop, beside the gRPC server: its socket is bound at start
(a port in use stops the gateway with the reason), it serves once the gateway is ready, and the
gateway's SIGTERM drains it with the gRPC calls (uvicorn's own signal handling stays off)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from starlette.applications import Starlette

from gateway.settings import GatewaySettings

log = logging.getLogger("gateway")


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, listening only once served; SystemExit if the port is taken
    (SO_REUSEADDR only outlives a previous run's closed connections, never shares a port)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port} for HTTP: {err.strerror}") from None
    return sock


class HttpServer(uvicorn.Server):
    def __init__(self, app: Starlette, settings: GatewaySettings) -> None:
        cert, key = settings.tls or (None, None)
        super().__init__(
            uvicorn.Config(
                app,
                log_config=None,  # the gateway's logging
                access_log=False,  # as gRPC calls, requests are counted in metrics, not logged
                lifespan="off",
                ws="none",
                timeout_graceful_shutdown=settings.drain_timeout,  # type: ignore[arg-type]
                ssl_certfile=cert,
                ssl_keyfile=key,
            )
        )
        self.scheme = "https" if settings.tls else "http"
        self.task: asyncio.Task | None = None

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the gateway's SIGTERM handler stops it: see drain()

    def start(self, sock: socket.socket) -> None:
        self.task = asyncio.create_task(self.serve(sockets=[sock]))
        host, port = sock.getsockname()[:2]
        log.info("OpenAI-compatible API on %s://%s:%d/v1", self.scheme, host, port)

    async def drain(self) -> None:
        """Stop accepting; the requests in flight get the graceful-shutdown time to finish."""
        self.should_exit = True

    async def stopped(self) -> None:
        await self.drain()
        if self.task is not None:
            await self.task
