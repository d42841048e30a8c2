"""What every service shares: an aio gRPC server with health, reflection and graceful stop."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ipaddress
import logging
import os
import signal
import ssl
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from llmcommon.auth import TokenInterceptor, token_interceptors
from llmcommon.flags import add_flags, from_args
from llmcommon.health import SERVING, HealthServicer, check_health
from llmcommon.metrics_http import MetricsSettings, ServesMetrics, metrics_host, start_metrics
from llmcommon.unreadable import ReadableRequests

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# On SIGTERM, in-flight calls get this long to finish (--drain-timeout): enough for a request of
# 512 tokens at CPU decode speed (docs/figures.md). Kubernetes' terminationGracePeriodSeconds
# must exceed it.
DRAIN_SECONDS = 60.0
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
# A peer that stops answering HTTP/2 pings for KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS loses its
# connection (its calls end): a hung or partitioned scheduler's step stream ends, so that a
# worker, which takes one stream at a time, can be driven by a replacement. The kernel closes a
# killed process's connections at once.
KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS = 20_000, 20_000
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # else a ping waits 60 s for its ack
    ("grpc.http2.max_pings_without_data", 0),  # an idle step stream sends no data for long
]
# Reconnect within a second of a peer coming back: gRPC's default backoff grows to 120 s, which a
# scheduler polling a restarted worker (or a gateway whose scheduler restarted) would wait.
CHANNEL_OPTIONS = [
    *SERVER_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

log = logging.getLogger("llmserve")
TLS_FLAGS = ("--tls-cert", "--tls-key")  # the gateway's: the one service that serves TLS
PARENT_PID_VAR = "LLMSERVE_PARENT_PID"  # set by `llmserve up` for the processes it starts
S = TypeVar("S")


def run_service(
    prog: str,
    settings: type[S],
    env_prefix: str,
    serve: Callable[[S], Awaitable[None]],
    argv: list[str] | None = None,
) -> None:
    """`python -m <prog>`: the `settings` dataclass from the command line (and $<env_prefix>*
    variables), then `serve` with it until the service stops."""
    die_with_parent()  # when started by `llmserve up`
    parser = argparse.ArgumentParser(prog=prog)
    add_flags(parser, settings, env_prefix=env_prefix)
    try:
        config = from_args(settings, parser.parse_args(argv))
    except ValueError as err:  # the settings' own checks: one line naming the flag, exit 2
        parser.error(str(err))
    asyncio.run(serve(config))


def die_with_parent() -> None:
    """Started by `llmserve up` (or a test's stack): get SIGTERM when that process dies, even by
    SIGKILL (Linux PR_SET_PDEATHSIG). Done here, at the child's start, rather than in a
    preexec_fn: code between fork and exec is unsafe in a parent with threads."""
    parent = os.environ.get(PARENT_PID_VAR)
    if not parent:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def setup_logging(name: str) -> logging.Logger:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    return logging.getLogger(name)


def internal_channel(target: str, token: str) -> grpc.aio.Channel:
    """A channel to another service; with a token, every call on it carries the token."""
    return grpc.aio.insecure_channel(
        target, options=CHANNEL_OPTIONS, interceptors=token_interceptors(token)
    )


class Server:
    """An aio server whose health reports NOT_SERVING until `ready()` and again on SIGTERM.
    With an internal `token`, every call of `service_names` must carry it."""

    def __init__(
        self,
        host: str,
        port: int,
        service_names: list[str],
        interceptors: list[grpc.aio.ServerInterceptor] | None = None,
        tls: tuple[str, str] | None = None,  # (certificate chain file, private key file)
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        token: str = "",
        extra_options: tuple[tuple[str, int], ...] = (),  # more grpc server arguments
    ) -> None:
        interceptors = list(interceptors or [])
        if not any(isinstance(i, ReadableRequests) for i in interceptors):
            interceptors.insert(0, ReadableRequests())  # an undecodable request: INVALID_ARGUMENT
        if token:  # outermost: nothing else sees an unauthenticated call
            interceptors = [TokenInterceptor(service_names, token), *interceptors]
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # never share a port: a second server on a busy port (a restarted worker while the
            # old one still lives, a test stack on a port another just took) must fail to start
            ("grpc.so_reuseport", 0),
            *KEEPALIVE_OPTIONS,
            *extra_options,
        ]
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = service_names
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        try:  # gRPC says "Failed to bind" (RuntimeError) or returns port 0
            if tls:
                credentials = tls_credentials(*tls)
                self.port = self.server.add_secure_port(f"{host}:{port}", credentials)
            else:
                self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise SystemExit(cannot_listen(f"{host}:{port}"))
        self.address = f"{host}:{self.port}"
        if not is_loopback(host) and not any(
            isinstance(i, TokenInterceptor) for i in interceptors or ()
        ):
            log.warning(exposed_warning(self.address, service_names))
        self.stopping = asyncio.Event()

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def run(
        self,
        on_ready: Callable[[], Awaitable[None]] | None = None,
        grace: float = DRAIN_SECONDS,
        before_stop: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Start, call `on_ready`, serve until SIGTERM/SIGINT, then stop gracefully.

        On SIGTERM health turns NOT_SERVING first; `before_stop` (e.g. a worker's drain) runs
        while calls are still served; then the server stops, with `grace` for in-flight calls."""
        await self.set_serving(False)
        try:
            await self.server.start()
        except RuntimeError:
            raise SystemExit(cannot_listen(self.address)) from None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        if on_ready is not None:
            await on_ready()
        await self.set_serving(True)
        log.info("serving on %s", self.address)
        await self.stopping.wait()
        log.info("stopping: NOT_SERVING, %.0f s grace for in-flight calls", grace)
        await self.health.close()  # NOT_SERVING for good; health Watch streams end
        if before_stop is not None:
            await before_stop()
        await self.server.stop(grace)


def cannot_listen(address: str, purpose: str = "") -> str:
    what = f"{address} for {purpose}" if purpose else address
    return f"cannot listen on {what}: the address is in use or not available"


def serve_metrics(metrics: ServesMetrics, settings: MetricsSettings, log: logging.Logger) -> None:
    """start_metrics; a port it cannot listen on stops the service with one line (SystemExit),
    as the gRPC port does."""
    try:
        start_metrics(metrics, settings, log)
    except OSError:
        where = metrics_host(settings.host, settings.metrics_host)
        raise SystemExit(cannot_listen(f"{where}:{settings.metrics_port}", "metrics")) from None


def tls_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    """The server's credentials from its PEM files, checked first: gRPC reports a certificate
    or key it cannot use as a port it cannot bind. SystemExit naming the flag and the file."""
    chain, private = read_tls_file(TLS_FLAGS[0], cert), read_tls_file(TLS_FLAGS[1], key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # only what gRPC cannot load, not a weak key
    try:
        context.load_verify_locations(cadata=chain.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError):  # ValueError: empty
        raise SystemExit(f"{TLS_FLAGS[0]} {cert}: no PEM certificate in it") from None
    try:  # a password callback: an encrypted key is refused, never asked for on the terminal
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as err:
        if err.reason == "KEY_VALUES_MISMATCH":
            why = f"not the private key of the certificate in {TLS_FLAGS[0]} {cert}"
        else:
            why = "no unencrypted PEM private key in it"
        raise SystemExit(f"{TLS_FLAGS[1]} {key}: {why}") from None
    return grpc.ssl_server_credentials([(private, chain)])


def read_tls_file(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise SystemExit(f"{flag} {path}: cannot read it: {err.strerror}") from None


def is_loopback(host: str) -> bool:
    """Whether `host` reaches this machine only ("localhost", 127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, or "" (every address)
        return False


def exposed_warning(address: str, service_names: list[str]) -> str:
    return (
        f"LISTENING ON {address} WITHOUT A TOKEN: any process that reaches this address can "
        f"call {', '.join(service_names)} (submit and cancel requests, read the status, take "
        "over a worker's step stream). Set --internal-token-file (or $LLMSERVE_INTERNAL_TOKEN) "
        "on every service (the gateway: --api-key-file), or listen on loopback only"
    )


async def wait_healthy(target: str, timeout: float, service: str = "") -> None:
    """Poll a server's health until SERVING; raise TimeoutError after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with grpc.aio.insecure_channel(target) as channel:
        while True:
            try:
                if await check_health(channel, service, timeout=1) == SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{target} not SERVING after {timeout:.0f} s")
            await asyncio.sleep(0.1)
