"""The HTTP server's guards against slow and idle clients (gateway/http_server.py), over real
sockets on loopback against the gateway's own uvicorn server: a head or a body that does not
arrive within its timeout is closed, and connections past the cap are answered 503 and closed
at once. Every wait is on the socket (its close, its answer) with a generous bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.http_server import HttpServer, bind
from gateway.settings import GatewaySettings

BOUND_S = 30.0  # far past every timeout here: reached only if a guard fails
# a 0.5 s timeout, as the client sees it: the server's clock starts when it accepts the
# connection, a moment before the client's (0.4993 s was measured once on a loaded host)
EARLIEST = 0.45
HEAD = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\n"
Opened = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class Echo:
    """An app that answers a request with its body and records the bodies it lost."""

    def __init__(self) -> None:
        self.disconnected = asyncio.Event()

    async def echo(self, request: Request) -> Response:
        try:
            return Response(await request.body())
        except ClientDisconnect:
            self.disconnected.set()
            raise


@asynccontextmanager
async def serving(app: Echo, **settings) -> AsyncIterator[Opened]:
    """The gateway's HTTP server on a free loopback port; yields a connection opener."""
    server = HttpServer(
        Starlette(routes=[Route("/echo", app.echo, methods=["POST"])]),
        GatewaySettings(**settings),
    )
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server.start(sock)
    try:
        async with asyncio.timeout(BOUND_S):
            while not server.started:
                await asyncio.sleep(0.01)
        yield lambda: asyncio.open_connection("127.0.0.1", port)
    finally:
        await server.stopped()


async def closed_after(reader: asyncio.StreamReader, trickle=None) -> tuple[bytes, float]:
    """(what the server sent, seconds) until it closes the connection; `trickle`, if given, is
    awaited between reads (a client still sending)."""
    start, got = time.monotonic(), b""
    async with asyncio.timeout(BOUND_S):
        while True:
            read = asyncio.ensure_future(reader.read(1 << 16))
            if trickle is not None:
                done, _ = await asyncio.wait({read}, timeout=0.1)
                if not done:
                    await trickle()
            chunk = await read
            if not chunk:
                return got, time.monotonic() - start
            got += chunk


def trickled(writer: asyncio.StreamWriter, data: bytes):
    """A sender of `data` one byte per call (then nothing)."""
    remaining = iter(data)

    async def send() -> None:
        byte = next(remaining, None)
        if byte is not None and not writer.is_closing():
            writer.write(bytes([byte]))
            try:
                await writer.drain()
            except ConnectionError:
                pass

    return send


def test_a_head_sent_a_byte_at_a_time_is_closed_within_the_header_timeout() -> None:
    async def scenario() -> float:
        async with serving(Echo(), http_header_timeout=0.5) as connect:
            reader, writer = await connect()
            endless = b"GET / HTTP/1.1\r\nx-slow: " + b"a" * 10_000  # a head that never ends
            _, seconds = await closed_after(reader, trickled(writer, endless))
            writer.close()
            return seconds

    seconds = asyncio.run(scenario())
    assert EARLIEST <= seconds < BOUND_S


def test_an_idle_connection_that_sends_nothing_is_closed_within_the_header_timeout() -> None:
    async def scenario() -> float:
        async with serving(Echo(), http_header_timeout=0.5) as connect:
            reader, writer = await connect()
            _, seconds = await closed_after(reader)
            writer.close()
            return seconds

    assert EARLIEST <= asyncio.run(scenario()) < BOUND_S


def test_the_next_head_on_a_kept_alive_connection_has_the_same_deadline() -> None:
    """After a response the client may start its next request, but not trickle it forever."""

    async def scenario() -> tuple[bytes, float]:
        async with serving(Echo(), http_header_timeout=0.5) as connect:
            reader, writer = await connect()
            writer.write(HEAD + b"hello")
            answer = await reader.readuntil(b"hello")  # the whole answer: headers, then body
            got, seconds = await closed_after(reader, trickled(writer, HEAD[:-4] + b"a" * 9999))
            writer.close()
            return answer + got, seconds

    answer, seconds = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello")
    assert EARLIEST <= seconds < BOUND_S


def test_a_body_sent_a_byte_at_a_time_is_closed_within_the_body_timeout() -> None:
    app = Echo()

    async def scenario() -> float:
        async with serving(app, http_header_timeout=BOUND_S, http_body_timeout=0.5) as connect:
            reader, writer = await connect()
            writer.write(HEAD.replace(b"length: 5", b"length: 9999"))
            _, seconds = await closed_after(reader, trickled(writer, b"b" * 9999))
            writer.close()
            async with asyncio.timeout(BOUND_S):
                await app.disconnected.wait()  # the request saw its client gone
            return seconds

    assert EARLIEST <= asyncio.run(scenario()) < BOUND_S


def test_a_prompt_client_is_served_under_the_guards() -> None:
    async def scenario() -> bytes:
        async with serving(Echo(), http_header_timeout=0.5, http_body_timeout=0.5) as connect:
            reader, writer = await connect()
            writer.write(HEAD + b"hello")
            answer = await reader.readuntil(b"hello")
            writer.close()
            return answer

    assert asyncio.run(scenario()).startswith(b"HTTP/1.1 200")


def test_past_the_cap_a_connection_is_answered_503_and_closed_and_a_freed_place_serves() -> None:
    async def scenario() -> tuple[bytes, bytes]:
        async with serving(Echo(), http_max_connections=3, http_header_timeout=BOUND_S) as connect:
            held = [await connect() for _ in range(3)]
            # the server has them all once it answers on the last (one loop serves them in order)
            reader, writer = held[-1]
            writer.write(HEAD + b"hello")
            await reader.readuntil(b"hello")
            extra_reader, extra_writer = await connect()
            refused, _ = await closed_after(extra_reader)
            extra_writer.close()
            held[0][1].close()
            await held[0][1].wait_closed()
            answered = b""
            async with asyncio.timeout(BOUND_S):  # the server sees the close: a place frees up
                while not answered.startswith(b"HTTP/1.1 200"):
                    reader, writer = await connect()
                    writer.write(HEAD + b"hello")
                    try:
                        answered = await reader.readuntil(b"hello")
                    except asyncio.IncompleteReadError as err:
                        answered = err.partial  # refused again: not yet seen closed
                    except ConnectionError:
                        answered = b""  # refused again, reset before its answer was read
                    writer.close()
            for _, w in held[1:]:
                w.close()
            return refused, answered

    refused, answered = asyncio.run(scenario())
    assert refused.startswith(b"HTTP/1.1 503") and b'"code": "unavailable"' in refused
    assert answered.startswith(b"HTTP/1.1 200")
