"""Prometheus metrics of a worker: forward time and tokens per execution by phase, tokens sampled,
and the KV pool as the worker itself sees it (its KvReport)."""

from __future__ import annotations

from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from llmcommon.metrics_http import STEP_SECONDS_BUCKETS, TOKEN_COUNT_BUCKETS, serve_metrics
from llmcommon.v1 import worker_pb2
from worker_svc.work import BatchShape

if TYPE_CHECKING:
    from worker_svc.service import WorkerService

PHASES = ("prefill", "decode", "mixed")


class WorkerMetrics:
    def __init__(self, worker: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry or CollectorRegistry()
        self.worker = worker
        self.bytes_per_position = 0
        by_phase = {"labelnames": ["worker", "phase"], "registry": registry}
        self.forward = Histogram(
            "llmserve_worker_forward_duration_seconds",
            "One execution's forward pass, by phase",
            buckets=STEP_SECONDS_BUCKETS,
            **by_phase,
        )
        self.tokens = Histogram(
            "llmserve_worker_batch_tokens",
            "Tokens processed in one execution, by phase",
            buckets=TOKEN_COUNT_BUCKETS,
            **by_phase,
        )
        for phase in PHASES:
            self.forward.labels(worker, phase)
            self.tokens.labels(worker, phase)
        one = {"labelnames": ["worker"], "registry": registry}
        self.sampled = Counter(
            "llmserve_worker_sampled_tokens", "Tokens sampled (one per request per step)", **one
        ).labels(worker)
        self.capacity = Gauge(
            "llmserve_worker_kv_capacity_positions", "KV pool size in token positions", **one
        ).labels(worker)
        self.written = Gauge(
            "llmserve_worker_kv_written_positions",
            "KV positions written for live requests, as the worker sees its pool",
            **one,
        ).labels(worker)
        self.written_bytes = Gauge(
            "llmserve_worker_kv_written_bytes", "Memory of those written positions", **one
        ).labels(worker)
        self.pool_bytes = Gauge(
            "llmserve_worker_kv_pool_bytes", "Memory of the whole preallocated KV pool", **one
        ).labels(worker)
        blocks = Gauge(
            "llmserve_worker_kv_blocks",
            "KV blocks used by live requests, or free",
            ["worker", "state"],
            registry=registry,
        )
        self.used_blocks = blocks.labels(worker, "used")
        self.free_blocks = blocks.labels(worker, "free")

    def attach(self, service: WorkerService) -> None:
        """Set the service's hook; show the pool before the first execution."""
        info: worker_pb2.WorkerInfo = service.describe()
        self.bytes_per_position = info.bytes_per_position
        self.pool_bytes.set(info.pool_bytes)
        self.on_report(service.session.report())
        service.on_execute = self.on_execute

    def on_execute(
        self, shape: BatchShape | None, seconds: float, report: worker_pb2.KvReport
    ) -> None:
        if shape is not None:
            self.forward.labels(self.worker, shape.phase).observe(seconds)
            self.tokens.labels(self.worker, shape.phase).observe(shape.tokens)
            self.sampled.inc(shape.sampled)
        self.on_report(report)

    def on_report(self, report: worker_pb2.KvReport) -> None:
        self.capacity.set(report.capacity_positions)
        self.written.set(report.written_positions)
        self.written_bytes.set(report.written_positions * self.bytes_per_position)
        self.used_blocks.set(report.used_blocks)
        self.free_blocks.set(report.free_blocks)

    def serve(self, host: str, port: int) -> WSGIServer:
        return serve_metrics(self.registry, host, port)
