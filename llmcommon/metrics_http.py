"""Each service's metrics endpoint: its registry plus the standard `process_*` metrics, served
on `/metrics` only (prometheus_client's own server answers every path); and the histogram buckets
the services share."""

from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    ProcessCollector,
    disable_created_metrics,
    make_wsgi_app,
)

# Histogram buckets, one definition for the three services (seconds, or counts)
STEP_SECONDS_BUCKETS = (1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TOKEN_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
REQUEST_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LATENCY_BUCKETS = (5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_GAP_BUCKETS = (1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5)

METRICS_PATH = "/metrics"
METRICS_HOST_HELP = (
    'the address /metrics listens on ("" = --host): the figures are the operator\'s (the '
    "prefix cache's hits among them), so bind it where only the operator's Prometheus reaches"
)


class MetricsSettings(Protocol):
    host: str
    metrics_host: str
    metrics_port: int


class ServesMetrics(Protocol):
    def serve(self, host: str, port: int) -> WSGIServer: ...


def metrics_host(host: str, metrics_host: str) -> str:
    """Where /metrics listens: --metrics-host, else the service's --host."""
    return metrics_host or host


def start_metrics(metrics: ServesMetrics, settings: MetricsSettings, log: logging.Logger) -> None:
    """A service's /metrics on --metrics-host (else --host) and --metrics-port, logged."""
    where = metrics_host(settings.host, settings.metrics_host)
    metrics.serve(where, settings.metrics_port)
    log.info("metrics on http://%s:%d/metrics", where, settings.metrics_port)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base's name
        pass


def metrics_app(registry: CollectorRegistry):
    """A WSGI app: the registry's metrics on /metrics, 404 on every other path."""
    exposition = make_wsgi_app(registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO") == METRICS_PATH:
            return exposition(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"not found; metrics are on {METRICS_PATH}\n".encode()]

    return app


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serve `registry`, with the process's CPU, memory and file descriptors added, on
    http://host:port/metrics from a daemon thread."""
    disable_created_metrics()  # no `_created` series: nothing reads them
    ProcessCollector(registry=registry)
    server_class = _Server6 if ":" in host else _Server
    server = make_server(
        host, port, metrics_app(registry), server_class, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
