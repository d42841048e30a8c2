"""Prometheus metrics of the scheduler.

Queue, KV and stall figures are read from the core's `snapshot()` when Prometheus scrapes (on the
event loop, where the core lives); batch sizes and execution times are observed once per step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Histogram,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmcommon.metrics_http import (
    REQUEST_COUNT_BUCKETS,
    STEP_SECONDS_BUCKETS,
    TOKEN_COUNT_BUCKETS,
    serve_metrics,
)
from llmcommon.tenancy import DEFAULT_TENANT
from scheduler_svc.config import QueuePolicy, Speculative
from scheduler_svc.core import Scheduler
from scheduler_svc.live_settings import NAMES
from scheduler_svc.output import Snapshot, TenantCounts
from scheduler_svc.reasons import RefusalReason, StallReason
from scheduler_svc.step import Step
from scheduler_svc.step_model import PredictionError, StepModels

if TYPE_CHECKING:
    from scheduler_svc.service import SchedulerService

PREFIX = "llmserve_scheduler_"
KV_STATES = ("written", "reserved_unwritten", "free")
T = TypeVar("T")


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry or CollectorRegistry()
        self.core: Scheduler | None = None
        self.batch_requests = Histogram(
            "llmserve_scheduler_batch_requests",
            "Requests in one execution on a worker",
            ["worker"],
            buckets=REQUEST_COUNT_BUCKETS,
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "llmserve_scheduler_batch_tokens",
            "Tokens processed in one execution on a worker (at most the token budget)",
            ["worker"],
            buckets=TOKEN_COUNT_BUCKETS,
            registry=registry,
        )
        self.execution = Histogram(
            "llmserve_scheduler_execution_duration_seconds",
            "One execution's forward pass on a worker, as the worker reports it",
            buckets=STEP_SECONDS_BUCKETS,
            registry=registry,
        )

    def attach(self, service: SchedulerService) -> None:
        """Follow `service.core` and observe each step; call on the loop the core runs on."""
        self.core = service.core
        service.on_step = self.on_step
        service.on_join = self.on_join
        self.registry.register(CoreCollector(service.core, _running_loop()))
        models = getattr(service, "step_models", None)  # a test's stand-in service may have none
        if models is not None:
            self.registry.register(StepModelCollector(service.core, models, _running_loop()))
        for ws in service.core.workers:
            self.on_join(ws.spec.name)

    def on_join(self, name: str) -> None:
        self.batch_requests.labels(name)
        self.batch_tokens.labels(name)

    def on_step(self, index: int, step: Step, seconds: float) -> None:
        self.execution.observe(seconds)
        name = self.core.workers[index].spec.name
        self.batch_requests.labels(name).observe(step.num_requests)
        self.batch_tokens.labels(name).observe(step.num_tokens)

    def serve(self, host: str, port: int) -> WSGIServer:
        return serve_metrics(self.registry, host, port)


class CoreCollector(Collector):
    """The core's snapshot as metric families; the snapshot is taken on the core's own loop."""

    def __init__(self, core: Scheduler, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.core = core
        self.loop = loop

    def describe(self) -> list[Metric]:
        return []  # registering must not take a snapshot (it may run on the loop itself)

    def collect(self) -> Iterator[Metric]:
        yield from families(self._snapshot(), self.core)
        yield from tenant_families(self._on_loop(self.core.tenant_counts))

    def _snapshot(self) -> Snapshot:
        return self._on_loop(self.core.snapshot)

    def _on_loop(self, read: Callable[[], T]) -> T:
        """`read()` on the core's loop (the scrape runs on another thread)."""
        if self.loop is None or _running_loop() is self.loop:
            return read()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def take() -> None:
            try:
                future.set_result(read())
            except BaseException as err:  # pragma: no cover - reported to the scrape
                future.set_exception(err)

        self.loop.call_soon_threadsafe(take)
        return future.result(timeout=5.0)


class StepModelCollector(CoreCollector):
    """Each worker's step-time model: its recent prediction error, read on the core's loop."""

    def __init__(
        self, core: Scheduler, models: StepModels, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        super().__init__(core, loop)
        self.models = models

    def collect(self) -> Iterator[Metric]:
        error = GaugeMetricFamily(
            PREFIX + "step_prediction_error_ratio",
            "abs(predicted - measured) / measured of the worker's recent steps (its online "
            "step-time model), at the quantile q",
            labels=["worker", "q"],
        )
        for name, figures in self._on_loop(self._errors):
            error.add_metric([name, "0.5"], figures.p50)
            error.add_metric([name, "0.9"], figures.p90)
        yield error

    def _errors(self) -> list[tuple[str, PredictionError]]:
        workers = self.core.workers
        out = []
        for index, model in sorted(self.models.models.items()):
            figures = model.error()
            if figures is not None and not workers[index].gone:
                out.append((workers[index].spec.name, figures))
        return out


def families(snap: Snapshot, core: Scheduler) -> Iterator[Metric]:
    yield from _queue(snap, core)
    yield from _counters(snap)
    yield from _workers(snap)
    yield from _prefix_cache(snap)
    yield from _speculative(core)
    yield _setting_changes(core)


def _queue(snap: Snapshot, core: Scheduler) -> Iterator[Metric]:
    cfg = core.config
    yield _gauge("waiting_requests", "Requests in the waiting queue", snap.waiting)
    yield _gauge(
        "waiting_tokens", "Tokens the waiting requests still have to process", snap.waiting_tokens
    )
    yield _gauge("oldest_wait_seconds", "Age of the oldest waiting request", snap.oldest_wait)
    yield _gauge("token_budget", "Token budget of one execution, per worker", cfg.token_budget)
    yield _gauge("max_running_requests", "Running-request limit, per worker", cfg.max_running)
    yield _gauge(
        "step_time_budget_seconds",
        "Step-time budget: the longest a worker's step may be predicted to take (0 = off)",
        cfg.step_time_budget_ms / 1e3,
    )
    yield _gauge(
        "step_budget_window_steps",
        "The steps of a worker over which the step-time budget holds on average (1 = each step)",
        cfg.step_time_window,
    )
    yield _gauge(
        "decode_steps",
        "Executions per step when a worker only decodes and no request waits (1 = one)",
        cfg.decode_steps,
    )
    yield _total(
        "run_steps",
        "Steps planned with several executions of their decodes (--decode-steps)",
        core.run_steps,
    )
    info = GaugeMetricFamily(
        PREFIX + "info",
        "1, with the scheduler's settings",
        labels=["policy", "mode", "chunked_prefill", "prefix_caching"],
    )
    flags = [str(cfg.chunked_prefill).lower(), str(core.caching).lower()]  # as it takes effect
    info.add_metric([cfg.policy.value, cfg.mode.value, *flags], 1)
    yield info
    head = GaugeMetricFamily(
        PREFIX + "queue_head_blocked",
        "1 for the limit that holds the head of the queue back now",
        labels=["reason"],
    )
    for reason in StallReason:
        head.add_metric([reason.value], float(snap.head_wait_reason == reason.value))
    yield head


def _counters(snap: Snapshot) -> Iterator[Metric]:
    stalls = CounterMetricFamily(
        PREFIX + "admission_stalls",
        "Steps whose admission stopped, by the limit that stopped it; priority, fair_share, "
        "deadline: steps in which the ordering held the longest-waiting request behind the head",
        labels=["reason"],
    )
    for reason in StallReason:
        stalls.add_metric([reason.value], snap.stalls.get(reason.value, 0))
    yield stalls
    refused = CounterMetricFamily(
        PREFIX + "refused_requests",
        "Requests refused at submit because they can never run",
        labels=["reason"],
    )
    for reason, count in sorted((dict.fromkeys(RefusalReason, 0) | snap.refused).items()):
        refused.add_metric([reason], count)
    yield refused
    yield _total("preemptions", "Running requests preempted to free KV", snap.preemptions)
    yield _total("admissions", "Admissions to a batch (again after a preemption)", snap.admitted)
    yield _total("finished_requests", "Requests finished for any reason", snap.finished)
    yield _total(
        "steps", "Executions planned (a step of several executions counts each)", snap.steps
    )


def _speculative(core: Scheduler) -> Iterator[Metric]:
    """Speculative decoding, under vLLM's names (spec_decode_*): acceptance rate =
    accepted / draft tokens; mean acceptance length per draft = 1 + accepted / drafts."""
    cfg = core.config
    on = cfg.speculative is not Speculative.OFF
    yield _gauge(
        "spec_decode_num_speculative_tokens",
        "The longest draft a request takes in a step (--num-speculative-tokens; 0 = off)",
        cfg.num_speculative_tokens if on else 0,
    )
    yield _total(
        "spec_decode_num_drafts", "Drafts verified (decodes with a draft)", core.spec_drafts
    )
    yield _total(
        "spec_decode_num_draft_tokens", "Draft tokens proposed and verified", core.spec_draft_tokens
    )
    yield _total(
        "spec_decode_num_accepted_tokens",
        "Draft tokens the worker accepted",
        core.spec_accepted_tokens,
    )
    per_pos = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by their position in the draft (0 = the first)",
        labels=["position"],
    )
    counts = core.spec_accepted_per_pos
    for pos in range(max(cfg.num_speculative_tokens, max(counts, default=-1) + 1)):
        per_pos.add_metric([str(pos)], counts.get(pos, 0))
    yield per_pos
    yield from _potential(core)


POTENTIAL_FIGURES = (
    ("requests", "Finished requests replayed"),
    ("tokens", "Output tokens replayed"),
    ("steps", "Decode steps speculation would take for them (tokens / steps: tokens a step)"),
    ("draft_tokens", "Draft tokens it would verify"),
    ("accepted_tokens", "Draft tokens a verifying worker would accept"),
    (
        "step_seconds",
        "Seconds of those steps by the step-time model of the worker that ran each request, "
        "alone (one stream)",
    ),
    (
        "plain_seconds",
        "Seconds of one decode a token instead, by the same model (plain / step: the decode "
        "speed speculation would give at one stream)",
    ),
)


def _potential(core: Scheduler) -> Iterator[Metric]:
    """--speculation-potential: finished requests replayed against prompt lookup and the oracle
    (scheduler_svc/speculation/potential.py), speculating or not."""
    replayed = core.potential.replayed
    for figure, text in POTENTIAL_FIGURES:
        family = CounterMetricFamily(
            PREFIX + f"spec_potential_{figure}",
            f"{text}, by proposer (ngram: prompt lookup at this server's settings; oracle: the "
            "longest stretch found earlier in the request)",
            labels=["proposer"],
        )
        for name, r in replayed.items():
            family.add_metric([name], getattr(r, figure))
        yield family
    yield _total(
        "spec_potential_skipped",
        "Finished requests not replayed (a replay's quiet time: replays take at most a "
        "hundredth of the loop's time)",
        core.potential.skipped,
    )
    yield _total(
        "spec_potential_seconds", "Time the step loop spent replaying", core.potential.seconds
    )


def _workers(snap: Snapshot) -> Iterator[Metric]:
    running = GaugeMetricFamily(PREFIX + "running_requests", "Running requests", labels=["worker"])
    healthy = GaugeMetricFamily(
        PREFIX + "worker_healthy", "1 while the scheduler uses the worker", labels=["worker"]
    )
    draining = GaugeMetricFamily(
        PREFIX + "worker_draining",
        "1 while the worker drains (stopping: finishes its requests, takes no new ones)",
        labels=["worker"],
    )
    capacity = GaugeMetricFamily(
        PREFIX + "kv_capacity_positions", "KV pool size in token positions", labels=["worker"]
    )
    positions = GaugeMetricFamily(
        PREFIX + "kv_positions",
        "KV token positions by state: written, allocated but not yet written, free",
        labels=["worker", "state"],
    )
    stalls = CounterMetricFamily(
        PREFIX + "worker_admission_stalls",
        "Steps whose admission stopped, by the worker whose limit stopped it and the limit",
        labels=["worker", "reason"],
    )
    steps = CounterMetricFamily(
        PREFIX + "worker_steps", "Executions sent to the worker", labels=["worker"]
    )
    for kv in snap.workers:
        steps.add_metric([kv.name], kv.steps)
        for reason in StallReason:
            stalls.add_metric([kv.name, reason.value], kv.stalls.get(reason.value, 0))
        running.add_metric([kv.name], kv.running)
        healthy.add_metric([kv.name], float(kv.healthy))
        draining.add_metric([kv.name], float(kv.draining))
        capacity.add_metric([kv.name], kv.capacity)
        for state in KV_STATES:
            positions.add_metric([kv.name, state], getattr(kv, state))
    yield from (running, healthy, draining, capacity, positions, stalls, steps)


# (name, help, WorkerKv field) of each worker's prefix-cache figures: gauges, then counters
PREFIX_GAUGES = (
    ("kv_cached_blocks", "KV blocks whose contents the prefix cache holds", "cached_blocks"),
    (
        "kv_evictable_blocks",
        "Cached KV blocks no request holds: reusable, and free for other contents",
        "evictable_blocks",
    ),
)
PREFIX_COUNTERS = (
    (
        "prefix_cache_evictions",
        "Cached KV blocks taken for other contents",
        "evictions",
    ),
    (
        "prefix_prompt_tokens",
        "Tokens that needed KV when a request was admitted (again after a preemption)",
        "prompt_tokens",
    ),
    (
        "prefix_hit_tokens",
        "Of the prefix_prompt_tokens, those whose KV the prefix cache held",
        "hit_tokens",
    ),
)


def _prefix_cache(snap: Snapshot) -> Iterator[Metric]:
    for name, doc, field in PREFIX_GAUGES:
        gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["worker"])
        for kv in snap.workers:
            gauge.add_metric([kv.name], getattr(kv, field))
        yield gauge
    for name, doc, field in PREFIX_COUNTERS:
        counter = CounterMetricFamily(PREFIX + name, doc, labels=["worker"])
        for kv in snap.workers:
            counter.add_metric([kv.name], getattr(kv, field))
        yield counter


def _setting_changes(core: Scheduler) -> CounterMetricFamily:
    changes = CounterMetricFamily(
        PREFIX + "setting_changes",
        "Live changes of a setting applied (llmserve set; a restart starts from the flags)",
        labels=["setting"],
    )
    for name in NAMES:
        changes.add_metric([name], core.setting_changes.get(name, 0))
    return changes


MAX_LABELS = 64  # tenants and classes named in the metrics; the rest are counted as "other"


def _bounded(counts: dict[str, float]) -> dict[str, float]:
    """At most MAX_LABELS names (the tenants come from the gateway's keys file, so they are
    few; this bounds a caller that sends many), the rest summed under "other"; "" as "none"."""
    named = sorted(counts)
    out = {name or "none": float(counts[name]) for name in named[:MAX_LABELS]}
    rest = sum(counts[name] for name in named[MAX_LABELS:])
    if rest:
        out["other"] = out.get("other", 0) + rest
    return out


def tenant_families(counts: TenantCounts) -> Iterator[Metric]:
    """Waiting and running requests by tenant and SLO class; fair's service counters."""
    policy = GaugeMetricFamily(
        PREFIX + "queue_policy", "1 for the waiting queue's ordering now", labels=["policy"]
    )
    for p in QueuePolicy:
        policy.add_metric([p.value], float(counts.policy == p.value))
    yield policy
    for name, doc, values, label in (
        ("tenant_waiting_requests", "Waiting requests by tenant", counts.queued, "tenant"),
        ("tenant_running_requests", "Running requests by tenant", counts.running, "tenant"),
        (
            "class_waiting_requests",
            "Waiting requests by SLO class",
            counts.class_queued,
            "slo_class",
        ),
        (
            "class_running_requests",
            "Running requests by SLO class",
            counts.class_running,
            "slo_class",
        ),
        (
            "tenant_service",
            "A tenant's weighted service under the fair ordering (its VTC counter: prompt "
            "tokens x1 + sampled tokens x2, over its weight)",
            counts.service,
            "tenant",
        ),
    ):
        family = GaugeMetricFamily(PREFIX + name, doc, labels=[label])
        shown = {DEFAULT_TENANT if label == "tenant" else "none": 0.0} | _bounded(values)
        for value, count in shown.items():
            family.add_metric([value], count)
        yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _total(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
