"""The metrics modules in-process: the scheduler's families from the core (Figure 4), the worker's
phases and pool view, the gateway's status codes and latency hooks, and naming conventions."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import shutil
import subprocess
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.metrics import GatewayMetrics
from gateway.routing import Router
from gateway.service import Tally
from llmcommon.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2
from scheduler_svc.config import CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.reasons import StallReason
from scheduler_svc.step_cost import BatchShape
from scheduler_svc.step_model import StepModels
from tests.sim import seq, step
from worker_svc.metrics import WorkerMetrics
from worker_svc.work import WorkItem, phase_of, shape_of

LABELS = {
    "worker",
    "reason",
    "code",
    "phase",
    "state",
    "method",
    "protocol",
    "finish_reason",
    "policy",
    "mode",
    "chunked_prefill",
    "prefix_caching",
    "q",  # step_prediction_error_ratio: 0.5 or 0.9 (`quantile` is a summary's label)
    "setting",
    "tenant",  # configured in the gateway's keys file; at most 64 named
    "cell",  # a gateway's --cells: one per cell's scheduler
    "slo_class",  # configured with --slo-classes
    "met",
    "limit",
    "position",  # of a draft token (speculative decoding): at most --num-speculative-tokens
    "proposer",  # spec_potential_*: ngram or oracle
    "le",
}


def figure4_metrics() -> tuple[SchedulerMetrics, Scheduler]:
    """The seed's Figure 4 under `reserve`: B holds 20 of 24 positions, C waits; one more step."""
    core = Scheduler(
        CoreConfig(token_budget=8, policy=KvPolicy.RESERVE), [WorkerSpec("w0", 24, 1, 4096)]
    )
    core.add(seq("B", 6, max_tokens=14))
    step(core)
    core.add(seq("C", 6, max_tokens=6))
    metrics = SchedulerMetrics()
    service = SimpleNamespace(core=core, on_step=None, on_join=None)
    metrics.attach(service)
    [planned] = core.schedule_all()
    service.on_step(0, planned, 0.02)
    core.complete(planned, [7])
    return metrics, core


def test_scheduler_metrics_show_figure4_kv_and_the_kv_reserved_stall() -> None:
    metrics, _ = figure4_metrics()
    value = metrics.registry.get_sample_value
    kv = {
        s: value("llmserve_scheduler_kv_positions", {"worker": "w0", "state": s})
        for s in ("written", "reserved_unwritten", "free")
    }
    assert kv == {"written": 7, "reserved_unwritten": 13, "free": 4}
    assert value("llmserve_scheduler_kv_capacity_positions", {"worker": "w0"}) == 24
    assert value("llmserve_scheduler_admission_stalls_total", {"reason": "kv_reserved"}) == 1
    assert value("llmserve_scheduler_admission_stalls_total", {"reason": "token_budget"}) == 0
    assert value("llmserve_scheduler_queue_head_blocked", {"reason": "kv_reserved"}) == 1
    assert value("llmserve_scheduler_queue_head_blocked", {"reason": "kv_capacity"}) == 0
    assert value("llmserve_scheduler_waiting_requests") == 1
    assert value("llmserve_scheduler_waiting_tokens") == 6
    assert value("llmserve_scheduler_running_requests", {"worker": "w0"}) == 1
    assert value("llmserve_scheduler_token_budget") == 8
    assert value("llmserve_scheduler_batch_tokens_sum", {"worker": "w0"}) == 1  # B's decode
    assert value("llmserve_scheduler_batch_requests_count", {"worker": "w0"}) == 1
    assert value("llmserve_scheduler_execution_duration_seconds_sum") == pytest.approx(0.02)
    assert value("llmserve_scheduler_refused_requests_total", {"reason": "kv_capacity"}) == 0


def test_scheduler_metrics_count_refusals_by_reason() -> None:
    metrics, core = figure4_metrics()
    with pytest.raises(Exception, match="KV positions"):
        core.add(seq("huge", 6, max_tokens=100))
    value = metrics.registry.get_sample_value
    assert value("llmserve_scheduler_refused_requests_total", {"reason": "kv_capacity"}) == 1


def test_a_scrape_from_another_thread_takes_the_snapshot_on_the_core_loop() -> None:
    async def scrape_while_serving() -> bytes:
        metrics, _ = figure4_metrics()
        metrics.attach(
            SimpleNamespace(
                core=Scheduler(CoreConfig(), [WorkerSpec("w1", 8, 1, 64)]),
                on_step=None,
                on_join=None,
            )
        )
        return await asyncio.to_thread(generate_latest, metrics.registry)

    text = asyncio.run(asyncio.wait_for(scrape_while_serving(), timeout=10)).decode()
    assert 'llmserve_scheduler_kv_positions{state="free",worker="w1"} 8.0' in text


def test_worker_phase_of_an_execution() -> None:
    prefill = WorkItem("a", [1, 2, 3], 0, [0])
    decode = WorkItem("b", [7], 5, [1], sample_index=2)
    assert phase_of([prefill]) == "prefill"
    assert phase_of([decode, decode]) == "decode"
    assert phase_of([decode, prefill]) == "mixed"


def test_worker_metrics_follow_executions_and_the_pool_report() -> None:
    metrics = WorkerMetrics("worker0")
    metrics.bytes_per_position = 100
    report = worker_pb2.KvReport(
        capacity_positions=64, written_positions=9, used_blocks=3, free_blocks=13
    )
    items = [WorkItem("a", [1] * 8, 0, [0, 1]), WorkItem("b", [7], 5, [2], sample_index=2)]
    metrics.on_execute(shape_of(items), 0.25, report)
    metrics.on_execute(None, 0.0, worker_pb2.KvReport(capacity_positions=64, free_blocks=16))
    value = metrics.registry.get_sample_value
    one = {"worker": "worker0", "phase": "mixed"}
    assert value("llmserve_worker_forward_duration_seconds_sum", one) == 0.25
    assert value("llmserve_worker_batch_tokens_sum", one) == 9
    assert (
        value(
            "llmserve_worker_forward_duration_seconds_count",
            {"worker": "worker0", "phase": "decode"},
        )
        == 0
    )
    assert value("llmserve_worker_sampled_tokens_total", {"worker": "worker0"}) == 2
    assert value("llmserve_worker_kv_written_positions", {"worker": "worker0"}) == 0  # released
    assert value("llmserve_worker_kv_blocks", {"worker": "worker0", "state": "free"}) == 16
    assert value("llmserve_worker_kv_capacity_positions", {"worker": "worker0"}) == 64


def test_gateway_latency_hooks_observe_first_token_gaps_and_the_end() -> None:
    metrics = GatewayMetrics()
    tally = Tally(received=100.0, prompt_tokens=5, queue_time=0.5)
    for now in (101.0, 101.25, 101.75):
        metrics.on_tokens(tally, 1, now)
        tally.first_token_at = tally.first_token_at or now
        tally.last_token_at = now
    metrics.on_finish(common_pb2.FINISH_REASON_LENGTH, tally)
    metrics.on_finish(common_pb2.FINISH_REASON_UNSPECIFIED, Tally(prompt_tokens=9))  # refused
    value = metrics.registry.get_sample_value
    assert value("llmserve_gateway_time_to_first_token_seconds_sum") == 1.0
    assert value("llmserve_gateway_inter_token_latency_seconds_count") == 2
    assert value("llmserve_gateway_inter_token_latency_seconds_sum") == 0.75
    assert value("llmserve_gateway_request_queue_time_seconds_sum") == 0.5
    assert value("llmserve_gateway_generated_tokens_total") == 3
    assert value("llmserve_gateway_prompt_tokens_total") == 5  # the refused one produced nothing
    assert value("llmserve_gateway_e2e_request_latency_seconds_count") == 1
    assert value("llmserve_gateway_requests_finished_total", {"finish_reason": "length"}) == 1
    assert value("llmserve_gateway_requests_finished_total", {"finish_reason": "none"}) == 1


def test_every_finish_reason_is_counted_under_its_own_label() -> None:
    """One request of each reason, and one of a reason this gateway does not know (a newer
    scheduler's): each lands on its own label, the unknown one on "none"."""
    metrics = GatewayMetrics()
    reasons = {
        common_pb2.FINISH_REASON_STOP: "stop",
        common_pb2.FINISH_REASON_LENGTH: "length",
        common_pb2.FINISH_REASON_CANCELLED: "cancelled",
        common_pb2.FINISH_REASON_ERROR: "error",
        common_pb2.FINISH_REASON_UNSPECIFIED: "none",
    }
    expected = {}
    for count, (reason, label) in enumerate(reasons.items(), start=1):
        for _ in range(count):  # a different count per reason: no two labels can be swapped
            metrics.on_finish(reason, Tally())
        expected[label] = count
    metrics.on_finish(99, Tally())
    expected["none"] += 1
    counted = {
        s.labels["finish_reason"]: s.value
        for family in metrics.registry.collect()
        if family.name == "llmserve_gateway_requests_finished"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert counted == expected


class FakeGateway(gateway_pb2_grpc.GatewayServicer):
    """Answers by prompt: "ok", "bad" (INVALID_ARGUMENT), "full" (RESOURCE_EXHAUSTED), "slow"."""

    async def Generate(self, request, context):
        if request.prompt == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")
        yield gateway_pb2.GenerateResponse(delta=gateway_pb2.TokenDelta(text="x"))
        if request.prompt == "slow":
            await asyncio.sleep(30)

    async def GenerateUnary(self, request, context):
        if request.prompt == "full":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        return gateway_pb2.GenerateResult(text="x")


async def drain(call) -> list:
    return [message async for message in call]


async def call_fake_gateway(metrics: GatewayMetrics) -> None:
    server = grpc.aio.server(interceptors=metrics.interceptors())
    gateway_pb2_grpc.add_GatewayServicer_to_server(FakeGateway(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            assert await drain(stub.Generate(gateway_pb2.GenerateRequest(prompt="ok")))
            await stub.GenerateUnary(gateway_pb2.GenerateRequest(prompt="ok"))
            calls = [
                stub.Generate(gateway_pb2.GenerateRequest(prompt="bad")),
                stub.GenerateUnary(gateway_pb2.GenerateRequest(prompt="full")),
                stub.Generate(gateway_pb2.GenerateRequest(prompt="slow"), timeout=0.5),
            ]
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError):
                    await (call if isinstance(call, grpc.aio.UnaryUnaryCall) else drain(call))
            slow = stub.Generate(gateway_pb2.GenerateRequest(prompt="slow"))
            await slow.read()
            slow.cancel()
            await asyncio.sleep(0.3)
    finally:
        await server.stop(None)


def test_gateway_counts_calls_by_method_and_final_status_code() -> None:
    metrics = GatewayMetrics()
    asyncio.run(call_fake_gateway(metrics))
    value = metrics.registry.get_sample_value
    counted = [
        s
        for family in metrics.registry.collect()
        if family.name == "llmserve_gateway_requests"
        for s in family.samples
        if s.name.endswith("_total") and s.value
    ]
    assert {s.labels["protocol"] for s in counted} == {"grpc"}
    count = {(s.labels["method"], s.labels["code"]): s.value for s in counted}
    assert count == {
        ("Generate", "OK"): 1,
        ("GenerateUnary", "OK"): 1,
        ("Generate", "INVALID_ARGUMENT"): 1,
        ("GenerateUnary", "RESOURCE_EXHAUSTED"): 1,
        ("Generate", "DEADLINE_EXCEEDED"): 1,
        ("Generate", "CANCELLED"): 1,
    }
    assert value("llmserve_gateway_requests_in_flight") == 0


def all_families(registry: CollectorRegistry | None = None) -> list:
    registry = registry or CollectorRegistry()
    gateway = GatewayMetrics(registry)
    gateway.tenants.configure(["default"], ["interactive"])  # a class's too
    gateway.cells.follow(SimpleNamespace(cells={"cell0": None}, router=Router(["cell0"])))
    WorkerMetrics("worker0", registry)
    models = StepModels()
    models.observe(0, BatchShape(1, 1, 5, 5), 0.02)  # a step seen: its error is exported
    SchedulerMetrics(registry).attach(
        SimpleNamespace(
            core=Scheduler(CoreConfig(), [WorkerSpec("w0", 8, 1, 64)]),
            on_step=None,
            on_join=None,
            step_models=models,
        )
    )
    return list(registry.collect())


def test_metric_names_and_labels_follow_prometheus_conventions() -> None:
    families = all_families()
    assert len(families) >= 35
    for family in families:
        assert family.name.startswith("llmserve_"), family.name
        assert family.documentation, family.name
        for sample in family.samples:
            assert set(sample.labels) <= LABELS, (sample.name, sample.labels)
            if family.type == "counter" and not sample.name.endswith("_created"):
                assert sample.name.endswith("_total"), sample.name
        if "duration" in family.name or "latency" in family.name or "time" in family.name:
            assert family.name.endswith("_seconds"), family.name


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool: `make prometheus`")
def test_promtool_finds_nothing_to_object_to_in_every_services_exposition() -> None:
    """Prometheus' own linter over every family the three services export (it refused a gauge
    labelled `quantile`, a summary's label)."""
    registry = CollectorRegistry()
    all_families(registry)
    done = subprocess.run(
        ["promtool", "check", "metrics"], input=generate_latest(registry),
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr).decode()


def scheduler_scrape(core: Scheduler) -> dict[tuple[str, tuple], float]:
    """Every sample of the scheduler's families: (name, sorted labels) -> value."""
    metrics = SchedulerMetrics()
    metrics.attach(SimpleNamespace(core=core, on_step=None, on_join=None))
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in metrics.registry.collect()
        for s in family.samples
    }


def test_the_scheduler_families_report_the_cores_snapshot() -> None:
    """Each snapshot figure under its own name and labels, on two workers with different
    stalls, one failed, after a refusal and a finished request."""
    clock = itertools.count(10.0).__next__  # each reading one second later
    core = Scheduler(
        CoreConfig(token_budget=16, max_running=1, chunked_prefill=False),
        [WorkerSpec("w0", 40, 1, 4096), WorkerSpec("w1", 30, 1, 4096)],
        clock=clock,
    )
    for rid in ("a", "b", "c"):
        core.add(seq(rid, 5, 1 if rid == "a" else 20))
    with pytest.raises(Exception, match="token budget"):
        core.add(seq("long", 20, 1))
    step(core)  # a (1 token: done) on w0, b on w1; c waits (max_running)
    step(core)  # a leaves w0, c joins it
    core.fail_worker(1)  # b back to the queue's front
    core.clock = lambda: 30.0
    snap = core.snapshot()
    got = scheduler_scrape(core)

    def value(name: str, **labels) -> float:
        return got[(f"llmserve_scheduler_{name}", tuple(sorted(labels.items())))]

    assert value("waiting_requests") == snap.waiting == 1
    assert value("waiting_tokens") == snap.waiting_tokens == 5 + 2  # b's prompt and output
    assert value("oldest_wait_seconds") == snap.oldest_wait == 30 - 11  # b arrived at 11
    assert (value("token_budget"), value("max_running_requests")) == (16, 1)
    flags = {"chunked_prefill": "false", "prefix_caching": "true"}
    assert value("info", policy="paged", mode="continuous", **flags) == 1
    reasons = {r: value("admission_stalls_total", reason=r) for r in snap.stalls}
    assert reasons == snap.stalls and sum(reasons.values()) > 0
    head = {r.value: value("queue_head_blocked", reason=r.value) for r in StallReason}
    assert head == {r.value: float(r.value == snap.head_wait_reason) for r in StallReason}
    assert value("refused_requests_total", reason="token_budget") == 1
    assert value("refused_requests_total", reason="duplicate") == 0
    assert value("preemptions_total") == snap.preemptions == 1
    assert value("admissions_total") == snap.admitted == 3
    assert value("finished_requests_total") == snap.finished == 1
    assert value("steps_total") == snap.steps
    for kv in snap.workers:
        w = kv.name
        assert value("running_requests", worker=w) == kv.running
        assert value("worker_healthy", worker=w) == float(kv.healthy)
        assert value("worker_draining", worker=w) == 0
        assert value("kv_capacity_positions", worker=w) == kv.capacity
        assert value("worker_steps_total", worker=w) == kv.steps
        for state in ("written", "reserved_unwritten", "free"):
            assert value("kv_positions", worker=w, state=state) == getattr(kv, state)
        for r in StallReason:
            assert value("worker_admission_stalls_total", worker=w, reason=r.value) == (
                kv.stalls.get(r.value, 0)
            )
    assert [kv.healthy for kv in snap.workers] == [True, False]
    assert [kv.steps for kv in snap.workers] == [2, 2]
    core.drain_worker(0)
    assert scheduler_scrape(core)[("llmserve_scheduler_worker_draining", (("worker", "w0"),))] == 1


class Context:
    def __init__(self, code=None, remaining: float | None = None) -> None:
        self._code, self._remaining = code, remaining

    def code(self):
        return self._code

    def time_remaining(self):
        return self._remaining


@pytest.mark.parametrize(
    ("code", "name"),
    [
        (None, None),
        (grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"),
        (grpc.StatusCode.INVALID_ARGUMENT.value[0], "INVALID_ARGUMENT"),  # as an int
        (999, "UNKNOWN"),
    ],
)
def test_the_status_code_label_is_the_codes_name(code, name) -> None:
    from gateway.metrics import _code

    assert _code(Context(code)) == name


@pytest.mark.parametrize(
    ("context", "err", "name"),
    [
        (Context(grpc.StatusCode.NOT_FOUND), RuntimeError(), "NOT_FOUND"),
        (Context(grpc.StatusCode.OK), RuntimeError(), "UNKNOWN"),
        (Context(None, remaining=0.0), asyncio.CancelledError(), "DEADLINE_EXCEEDED"),
        # the client's own deadline cancels the call just before the gateway's copy passes
        (Context(None, remaining=0.004), asyncio.CancelledError(), "DEADLINE_EXCEEDED"),
        (Context(None, remaining=0.5), asyncio.CancelledError(), "CANCELLED"),
        (Context(None, remaining=None), GeneratorExit(), "CANCELLED"),
        (Context(None), ValueError(), "UNKNOWN"),
    ],
)
def test_a_failed_call_is_counted_under_what_ended_it(context, err, name) -> None:
    from gateway.metrics import _failure_code

    assert _failure_code(context, err) == name


def test_the_end_to_end_latency_runs_from_the_request_received() -> None:
    import time

    metrics = GatewayMetrics()
    tally = Tally(received=time.monotonic() - 5.0)
    tally.first_token_at = tally.received + 1.0
    metrics.on_finish(common_pb2.FINISH_REASON_STOP, tally)
    total = metrics.registry.get_sample_value("llmserve_gateway_e2e_request_latency_seconds_sum")
    assert 5.0 <= total < 6.0


def intercepted(method: str, handler) -> grpc.RpcMethodHandler:
    from gateway.metrics import StatusCodeInterceptor

    async def continuation(details):
        return handler

    interceptor = StatusCodeInterceptor(GatewayMetrics())
    details = SimpleNamespace(method=method, invocation_metadata=())
    return interceptor, asyncio.run(interceptor.intercept_service(continuation, details))


def test_a_unary_call_cancelled_in_flight_is_counted_cancelled_under_grpc() -> None:
    async def cancelled(request, context):
        raise asyncio.CancelledError

    handler = grpc.unary_unary_rpc_method_handler(cancelled)
    interceptor, counted = intercepted("/llmserve.v1.Gateway/GenerateUnary", handler)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(counted.unary_unary(None, Context(None, remaining=3.0)))
    samples = {
        tuple(sorted(s.labels.items())): s.value
        for family in interceptor.metrics.registry.collect()
        if family.name == "llmserve_gateway_requests"
        for s in family.samples
        if s.name.endswith("_total") and s.value
    }
    expected = (("code", "CANCELLED"), ("method", "GenerateUnary"), ("protocol", "grpc"))
    assert samples == {expected: 1}


@pytest.mark.parametrize(
    "method", ["/llmserve.v1.Gateway/Status", "/grpc.health.v1.Health/Check", "/other.Svc/Generate"]
)
def test_status_polls_and_other_services_are_not_counted(method) -> None:
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)
    _, returned = intercepted(method, handler)
    assert returned is handler  # not wrapped: never counted


def test_the_prefix_cache_figures_are_exported_per_worker() -> None:
    core = Scheduler(CoreConfig(), [WorkerSpec("w0", 40, 4, 64), WorkerSpec("w1", 40, 4, 64)])
    snap = core.snapshot()
    figures = dict(cached_blocks=9, evictable_blocks=4, evictions=2, prompt_tokens=70)
    snap.workers[0] = dataclasses.replace(snap.workers[0], hit_tokens=24, **figures)
    core.snapshot = lambda: snap
    got = scheduler_scrape(core)

    def value(name: str, worker: str) -> float:
        return got[(f"llmserve_scheduler_{name}", (("worker", worker),))]

    w0 = [value(n, "w0") for n in ("kv_cached_blocks", "kv_evictable_blocks")]
    assert w0 == [9, 4]
    totals = ("prefix_cache_evictions", "prefix_prompt_tokens", "prefix_hit_tokens")
    assert [value(n + "_total", "w0") for n in totals] == [2, 70, 24]
    assert [value(n + "_total", "w1") for n in totals] == [0, 0, 0]
    reserve = Scheduler(CoreConfig(policy=KvPolicy.RESERVE), [WorkerSpec("w0", 40, 4, 64)])
    info = [k for k in scheduler_scrape(reserve) if k[0] == "llmserve_scheduler_info"]
    assert ("prefix_caching", "false") in info[0][1]  # reserve leaves it off


def test_the_step_time_models_error_is_a_gauge_per_worker_and_quantile() -> None:
    core = Scheduler(CoreConfig(step_time_budget_ms=50), [WorkerSpec("w0", 8, 1, 64)])
    models = StepModels()
    shape = BatchShape(1, 1, 5, 5)
    first = models.predict(0, shape)
    models.observe(0, shape, first / 2)  # predicted twice what it took: error 100%
    metrics = SchedulerMetrics()
    metrics.attach(SimpleNamespace(core=core, on_step=None, on_join=None, step_models=models))
    value = metrics.registry.get_sample_value
    error = "llmserve_scheduler_step_prediction_error_ratio"
    assert value(error, {"worker": "w0", "q": "0.5"}) == pytest.approx(1.0)
    assert value(error, {"worker": "w0", "q": "0.9"}) == pytest.approx(1.0)
    assert value("llmserve_scheduler_step_time_budget_seconds") == pytest.approx(0.05)
