"""uvicorn in the gateway's own event loop, beside the gRPC server: its socket is bound at start
(a port in use stops the gateway with the reason), it serves once the gateway is ready, and the
gateway's SIGTERM drains it with the gRPC calls (uvicorn's own signal handling stays off).

The port is public and its clients are unauthenticated until their head is read, so each
connection is guarded (`GuardedH11Protocol`): its request head must arrive within
--http-header-timeout of the connection (or of its previous response), its body within
--http-body-timeout of its head, or it is closed; and beyond --http-max-connections open at once a
new connection is answered 503 and closed, so that slow clients can neither hold the gateway's
file descriptors (the gRPC API needs them too) nor its memory. A connection is refused only
once accepted, so one pass of the loop accepts at most `accept_batch` of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import socket
from dataclasses import dataclass

import h11
import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.settings import GatewaySettings

log = logging.getLogger("gateway")
REQUEST_IN = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)  # h11's client states past a body
BUSY_BODY = json.dumps(
    {
        "error": {
            "message": "the gateway has too many HTTP connections open; retry later",
            "type": "server_error",
            "param": None,
            "code": "unavailable",
        }
    }
).encode()
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\nretry-after: 1\r\ncontent-length: %d\r\n\r\n%s"
) % (len(BUSY_BODY), BUSY_BODY)


@dataclass(frozen=True, slots=True)
class ConnectionGuards:
    header_timeout: float  # seconds for a request's head, from the connection or last response
    body_timeout: float  # seconds for its whole body, from its head
    max_connections: int  # open at once; more are answered 503 and closed


def connection_cap(wanted: int, open_files: int) -> int:
    """At most half the process's file descriptors (`open_files`, its RLIMIT_NOFILE; negative:
    unlimited) go to HTTP connections: the gRPC API and the scheduler's channel need the rest."""
    return wanted if open_files < 0 else max(1, min(wanted, open_files // 2))


ACCEPT_BATCH = 256  # the most connections accepted in one pass of the event loop


def accept_batch(open_files: int) -> int:
    """The listen backlog, which asyncio also takes as the most connections it accepts in one
    pass of the loop, before any of them runs: those over the cap are answered and closed only
    after. uvicorn's 2,048 let a flood of pending connections take every file descriptor at
    once (EMFILE: accepting paused, gRPC's accepts failing too); at most a quarter of
    `open_files` (RLIMIT_NOFILE; negative: unlimited) and ACCEPT_BATCH keeps the rest free.
    A connection past the backlog waits in the kernel until a pass makes room."""
    return ACCEPT_BATCH if open_files < 0 else max(16, min(ACCEPT_BATCH, open_files // 4))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head and body, and a cap on the
    connections open at once (`guards`, set by `guarded`)."""

    guards: ConnectionGuards

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.deadline: asyncio.TimerHandle | None = None
        self.awaiting = "head"
        super().connection_made(transport)
        if len(self.connections) > self.guards.max_connections:
            self.connections.discard(self)  # never counted: it is closed now
            transport.write(BUSY)
            transport.close()
            return
        self._expect("head", self.guards.header_timeout)

    def handle_events(self) -> None:
        super().handle_events()
        theirs = self.conn.their_state
        if theirs is h11.SEND_BODY and self.awaiting == "head":
            self._expect("body", self.guards.body_timeout)
        elif theirs in REQUEST_IN and self.awaiting:
            self._cancel()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():  # the next request's head, from now
            self._expect("head", self.guards.header_timeout)
        super().on_response_complete()  # handles a pipelined request: handle_events

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def _expect(self, part: str, seconds: float) -> None:
        self._cancel()
        self.awaiting = part
        self.deadline = self.loop.call_later(seconds, self._late, part, seconds)

    def _cancel(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline, self.awaiting = None, ""

    def _late(self, part: str, seconds: float) -> None:
        """Closed: a request in progress sees its client gone (it is cancelled)."""
        self.deadline, self.awaiting = None, ""
        if not self.transport.is_closing():
            log.debug("closed an HTTP connection from %s: no request %s in %gs", self.client,
                      part, seconds)  # fmt: skip
            self.transport.close()


def guarded(guards: ConnectionGuards) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn builds each connection with, holding these guards."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guards": guards})


def guards_of(settings: GatewaySettings, open_files: int) -> ConnectionGuards:
    """The guards of every connection; `open_files`: the process's RLIMIT_NOFILE."""
    cap = connection_cap(settings.http_max_connections, open_files)
    if cap < settings.http_max_connections:
        log.warning(
            "--http-max-connections %d is more than half the %d open files this process may "
            "have: %d HTTP connections at most",
            settings.http_max_connections,
            open_files,
            cap,
        )
    return ConnectionGuards(settings.http_header_timeout, settings.http_body_timeout, cap)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio logs an accept that failed for want of a resource (EMFILE: the process's files
    are all open) with a traceback, once per connection pending, then pauses accepting for a
    second: one warning line a pause instead; every other error goes to the previous handler."""
    previous = loop.get_exception_handler()
    last = float("-inf")  # when the last warning was logged (loop time)

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        nonlocal last
        if context.get("message") != "socket.accept() out of system resource":
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        if loop.time() - last >= 1.0:
            last = loop.time()
            log.warning("HTTP: cannot accept a connection (%s); accepting again in 1 s",
                        context.get("exception"))  # fmt: skip

    loop.set_exception_handler(handle)


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
        open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        super().__init__(
            uvicorn.Config(
                app,
                http=guarded(guards_of(settings, open_files)),  # type: ignore[arg-type]
                backlog=accept_batch(open_files),
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
        quiet_accept_errors(asyncio.get_running_loop())
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
