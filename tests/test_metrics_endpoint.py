"""Each service's metrics endpoint: its own metrics and the standard process_* ones, on /metrics
and nowhere else."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from gateway.metrics import GatewayMetrics
from llmserve.ports import free_port
from scheduler_svc.metrics import SchedulerMetrics
from worker_svc.metrics import WorkerMetrics

SERVICES = {
    "gateway": (GatewayMetrics, "llmserve_gateway_"),
    "scheduler": (SchedulerMetrics, "llmserve_scheduler_"),
    "worker": (lambda: WorkerMetrics("worker0"), "llmserve_worker_"),
}


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.parametrize("service", SERVICES)
def test_metrics_are_served_on_slash_metrics_only_with_process_metrics(service: str) -> None:
    make, prefix = SERVICES[service]
    port = free_port()
    server = make().serve("127.0.0.1", port)
    try:
        code, body = get(f"http://127.0.0.1:{port}/metrics")
        assert code == 200 and prefix in body
        assert "process_cpu_seconds_total" in body and "process_resident_memory_bytes" in body
        for path in ("/", "/favicon.ico", "/metricsx", "/v1/models"):
            assert get(f"http://127.0.0.1:{port}{path}")[0] == 404, path
    finally:
        server.shutdown()
