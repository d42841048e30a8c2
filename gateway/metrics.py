"""Prometheus metrics of the gateway: calls by method, gRPC status code and protocol, requests by
finish reason, latencies (queue, first token, between tokens, end to end), tokens in and out,
requests in flight; per tenant and SLO class, gateway/tenant_metrics.py.

Latencies and prompt tokens count the requests that produced output; the status code counts
every call, refused ones included. Calls of the HTTP API count under their path with
protocol="http" and the gRPC code their HTTP status stands for (gateway/http_errors.py), so that
one `code` label reads the same for both protocols; the other families sum both protocols.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from gateway.cell_metrics import CellMetrics
from gateway.tenant_metrics import TenantMetrics
from llmcommon.metrics_http import LATENCY_BUCKETS, TOKEN_GAP_BUCKETS, serve_metrics
from llmcommon.v1 import common_pb2

if TYPE_CHECKING:
    from gateway.core import GatewayCore
    from gateway.key_table import KeyTable
    from gateway.usage import Tally

SERVICE_PREFIX = "/llmserve.v1.Gateway/"
UNCOUNTED = {"Status"}  # a status poll is not a request: it stays out of the request metrics
METHODS = ("Generate", "GenerateUnary")
HTTP_CHAT, HTTP_COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HTTP_METHODS = (HTTP_CHAT, HTTP_COMPLETIONS)
FINISH_LABELS = {
    common_pb2.FINISH_REASON_UNSPECIFIED: "none",  # refused by the scheduler, or failed
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",  # the client left, or its deadline passed
    common_pb2.FINISH_REASON_ERROR: "error",
}
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry or CollectorRegistry()
        self.requests = Counter(
            "llmserve_gateway_requests",
            "Gateway calls by method, final gRPC status code and protocol (grpc, http)",
            ["method", "code", "protocol"],
            registry=registry,
        )
        self.finished = Counter(
            "llmserve_gateway_requests_finished",
            "Requests handed to the scheduler, by finish reason (cancelled: the client left or "
            "its deadline passed; none: refused by the scheduler, or failed)",
            ["finish_reason"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "llmserve_gateway_requests_in_flight",
            "Gateway calls being served now",
            registry=registry,
        )
        self.queued_requests = Gauge(
            "llmserve_gateway_queued_requests",
            "Requests submitted to the scheduler and not yet admitted (the gateway's queue limit)",
            registry=registry,
        )
        self.queued_tokens = Gauge(
            "llmserve_gateway_queued_prompt_tokens",
            "Prompt tokens of those queued requests",
            registry=registry,
        )
        self.queue_time = Histogram(
            "llmserve_gateway_request_queue_time_seconds",
            "Submitted to the scheduler until first admitted to a batch",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "llmserve_gateway_time_to_first_token_seconds",
            "Received by the gateway until the first generated token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "llmserve_gateway_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            buckets=TOKEN_GAP_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "llmserve_gateway_e2e_request_latency_seconds",
            "Received by the gateway until the request ended",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "llmserve_gateway_prompt_tokens",
            "Prompt tokens of requests that produced output",
            registry=registry,
        )
        self.generated_tokens = Counter(
            "llmserve_gateway_generated_tokens",
            "Tokens generated and passed to clients",
            registry=registry,
        )
        self.resubmitted = Counter(
            "llmserve_gateway_resubmissions",
            "Requests sent again (with the tokens already streamed) because the scheduler "
            "holding them was lost",
            registry=registry,
        )
        for protocol, methods in (("grpc", METHODS), ("http", HTTP_METHODS)):
            for method in methods:
                for code in grpc.StatusCode:
                    self.requests.labels(method, code.name, protocol)
        for label in FINISH_LABELS.values():
            self.finished.labels(label)
        self.tenants = TenantMetrics(registry, FINISH_LABELS.values())
        self.cells = CellMetrics(registry)

    # ---- hooks of GatewayCore ------------------------------------------------------------

    def attach(self, core: GatewayCore) -> None:
        """Set the generation path's hooks and follow its admission queue."""
        core.observer = self.on_finish
        core.on_tokens = self.on_tokens
        core.on_queue_full = self.tenants.on_queue_full
        keys = core.keys
        keys.on_reload = self.follow_keys
        self.follow_keys(keys)
        self.queued_requests.set_function(lambda: core.queue.requests)
        self.queued_tokens.set_function(lambda: core.queue.tokens)
        if core.cells is not None:
            core.on_route = self.cells.on_route
            self.cells.follow(core.cells)

    def follow_keys(self, keys: KeyTable) -> None:
        """The tenants' and classes' label sets, as configured now."""
        self.tenants.configure(keys().tenants, keys.classes)

    def on_tokens(self, tally: Tally, count: int, now: float) -> None:
        """Called as tokens arrive, before `tally` records them."""
        self.generated_tokens.inc(count)
        self.tenants.on_tokens(tally, count, now)
        if tally.first_token_at is None:
            self.ttft.observe(now - tally.received)
            return
        gap = (now - (tally.last_token_at or tally.first_token_at)) / count
        for _ in range(count):
            self.inter_token.observe(gap)

    def on_finish(self, finish: int, tally: Tally) -> None:
        label = FINISH_LABELS.get(finish, "none")
        self.finished.labels(label).inc()
        self.tenants.on_finish(finish, label, tally)
        if tally.resubmits:
            self.resubmitted.inc()
        if tally.first_token_at is None:
            return
        self.prompt_tokens.inc(tally.prompt_tokens)
        self.queue_time.observe(tally.queue_time)
        self.e2e.observe(time.monotonic() - tally.received)

    def http_call(self, path: str) -> HttpCall:
        return HttpCall(self, path)

    # ---- the server side -----------------------------------------------------------------

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [StatusCodeInterceptor(self)]

    def serve(self, host: str, port: int) -> WSGIServer:
        return serve_metrics(self.registry, host, port)


class HttpCall:
    """One call of the HTTP API, in flight until `end(code)` (once; later calls are no-ops).
    Without metrics it counts nothing."""

    def __init__(self, metrics: GatewayMetrics | None, path: str) -> None:
        self.metrics, self.path = metrics, path
        if metrics is not None:
            metrics.in_flight.inc()

    def end(self, code: str) -> None:
        metrics, self.metrics = self.metrics, None
        if metrics is not None:
            metrics.in_flight.dec()
            metrics.requests.labels(self.path, code, "http").inc()


class StatusCodeInterceptor(grpc.aio.ServerInterceptor):
    """Counts every Gateway call by its final status code, and the calls in flight."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        name: str = handler_call_details.method
        method = name.removeprefix(SERVICE_PREFIX)
        if handler is None or not name.startswith(SERVICE_PREFIX) or method in UNCOUNTED:
            return handler
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._stream(method, handler.unary_stream))
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(method, handler.unary_unary))
        return handler

    def _unary(self, method: str, behavior: Callable[..., Awaitable[Any]]):
        async def counted(request, context):
            self.metrics.in_flight.inc()
            code = "UNKNOWN"
            try:
                reply = await behavior(request, context)
                code = _code(context) or "OK"
                return reply
            except BaseException as err:
                code = _failure_code(context, err)
                raise
            finally:
                self.metrics.in_flight.dec()
                self.metrics.requests.labels(method, code, "grpc").inc()

        return counted

    def _stream(self, method: str, behavior: Callable[..., AsyncIterator[Any]]):
        async def counted(request, context):
            self.metrics.in_flight.inc()
            code = "UNKNOWN"
            try:
                async for message in behavior(request, context):
                    yield message
                code = _code(context) or "OK"
            except BaseException as err:
                code = _failure_code(context, err)
                raise
            finally:
                self.metrics.in_flight.dec()
                self.metrics.requests.labels(method, code, "grpc").inc()

        return counted


def _code(context) -> str | None:
    """The status code set on the call (by abort or set_code), if any."""
    code = context.code()
    if code is None:
        return None
    if isinstance(code, grpc.StatusCode):
        return code.name
    return CODE_NAMES.get(code, "UNKNOWN")


# A client whose deadline passes cancels its call; the gateway's copy of that deadline (the
# client's grpc-timeout, counted from when the call arrived) is later by the call's transit, so
# the cancel can come a few milliseconds before the gateway's clock says the deadline passed (the
# chaos sweep saw one counted CANCELLED). A call that leaves this close to its deadline is counted
# as having reached it.
DEADLINE_SLACK_S = 0.1


def _failure_code(context, err: BaseException) -> str:
    code = _code(context)
    if code is not None and code != "OK":
        return code
    if isinstance(err, asyncio.CancelledError | GeneratorExit):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= DEADLINE_SLACK_S:
            return "DEADLINE_EXCEEDED"
        return "CANCELLED"
    return "UNKNOWN"
