"""The gateway's metrics per tenant and SLO class: requests by outcome, tokens served, TTFT and
TPOT, goodput (requests that met their class's targets) and refusals by a tenant's own queue
limit. Label values come only from the configuration (the keys' tenants, --slo-classes, `none`
for no class), so their number is bounded whatever clients send."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.queue_limits import QueueRefusal
from gateway.usage import Tally
from llmcommon.metrics_http import LATENCY_BUCKETS, TOKEN_GAP_BUCKETS
from llmcommon.tenancy import DEFAULT_TENANT, Tenancy
from llmcommon.v1 import common_pb2

NO_CLASS = "none"  # the slo_class label of a request without a class
TENANT_LIMITS = ("max_queued", "max_queued_tokens")
COMPLETED = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)


def class_label(tenancy: Tenancy) -> str:
    return tenancy.slo_class or NO_CLASS


def met_targets(tenancy: Tenancy, tally: Tally) -> bool:
    """Did a request that produced output meet its class's TTFT and TPOT targets?"""
    first = tally.first_token_at
    assert first is not None
    if tenancy.ttft_s and first - tally.received > tenancy.ttft_s:
        return False
    tpot = time_per_output_token(tally)
    return not (tenancy.tpot_s and tpot is not None and tpot > tenancy.tpot_s)


def time_per_output_token(tally: Tally) -> float | None:
    """Seconds per token after the first (None with fewer than two tokens)."""
    if tally.completion_tokens < 2 or tally.first_token_at is None:
        return None
    last = tally.last_token_at or tally.first_token_at
    return (last - tally.first_token_at) / (tally.completion_tokens - 1)


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry, finish_labels: Iterable[str]) -> None:
        self.finish_labels = tuple(finish_labels)
        self.requests = Counter(
            "llmserve_gateway_tenant_requests",
            "Requests handed to the scheduler, by tenant, SLO class (none: no class) and finish "
            "reason",
            ["tenant", "slo_class", "finish_reason"],
            registry=registry,
        )
        self.tokens = Counter(
            "llmserve_gateway_tenant_generated_tokens",
            "Tokens generated and passed to clients, by tenant",
            ["tenant"],
            registry=registry,
        )
        self.ttft = Histogram(
            "llmserve_gateway_tenant_time_to_first_token_seconds",
            "Received by the gateway until the first generated token, by tenant and SLO class",
            ["tenant", "slo_class"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "llmserve_gateway_tenant_time_per_output_token_seconds",
            "Time per generated token after the first, of requests that generated two or more, "
            "by tenant and SLO class",
            ["tenant", "slo_class"],
            buckets=TOKEN_GAP_BUCKETS,
            registry=registry,
        )
        self.slo = Counter(
            "llmserve_gateway_slo_requests",
            "Requests of an SLO class that completed (stop or length), by whether they met the "
            "class's TTFT and TPOT targets (met=true: goodput)",
            ["slo_class", "met"],
            registry=registry,
        )
        self.refusals = Counter(
            "llmserve_gateway_tenant_queue_refusals",
            "Requests refused by a tenant's own queue limit (max_queued, max_queued_tokens of "
            "its API keys), by tenant and limit",
            ["tenant", "limit"],
            registry=registry,
        )
        self.configure([DEFAULT_TENANT], [])

    def configure(self, tenants: Iterable[str], classes: Iterable[str]) -> None:
        """Every label set of these tenants and classes, at 0 (a reload adds the new ones)."""
        names = [NO_CLASS, *classes]
        for tenant in tenants:
            self.tokens.labels(tenant)
            for limit in TENANT_LIMITS:
                self.refusals.labels(tenant, limit)
            for name in names:
                self.ttft.labels(tenant, name)
                self.tpot.labels(tenant, name)
                for finish in self.finish_labels:
                    self.requests.labels(tenant, name, finish)
        for name in names[1:]:
            for met in ("true", "false"):
                self.slo.labels(name, met)

    def on_tokens(self, tally: Tally, count: int, now: float) -> None:
        tenancy = tally.tenancy
        self.tokens.labels(tenancy.tenant).inc(count)
        if tally.first_token_at is None:
            self.ttft.labels(tenancy.tenant, class_label(tenancy)).observe(now - tally.received)

    def on_finish(self, finish: int, finish_label: str, tally: Tally) -> None:
        tenancy = tally.tenancy
        label = class_label(tenancy)
        self.requests.labels(tenancy.tenant, label, finish_label).inc()
        if tally.first_token_at is None:
            return
        tpot = time_per_output_token(tally)
        if tpot is not None:
            self.tpot.labels(tenancy.tenant, label).observe(tpot)
        if tenancy.slo_class and finish in COMPLETED:
            met = met_targets(tenancy, tally)
            self.slo.labels(tenancy.slo_class, "true" if met else "false").inc()

    def on_queue_full(self, refusal: QueueRefusal) -> None:
        if refusal.limit:
            self.refusals.labels(refusal.tenant, refusal.limit).inc()
