"""Run a workload against a served stack: a running one (by address) or one started per config."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from llmserve.bench.loadgen import LoadGenerator
from llmserve.bench.policy import Policy
from llmserve.bench.poller import StatusPoller, counter_delta, counters_of
from llmserve.bench.records import RequestRecord, RunResult
from llmserve.bench.workload import Workload
from llmserve.ports import free_ports, free_run
from llmserve.stack import Stack, StackSettings

POLL_S = 0.25  # seconds between Status samples unless --poll says otherwise


async def run_workload(
    gateway: str,
    scheduler: str,
    workload: Workload,
    label: str,
    progress: bool = True,
    poll_s: float = POLL_S,
    warmup: int = 2,
    timeout_s: float | None = None,
    admin_key: str = "",
    status_flag: str = "",
) -> RunResult:
    """Warm up, then send `workload` while polling Status; counters are deltas over the run.
    Status comes from `scheduler`, or, with `scheduler` "", from the gateway (its scheduler's,
    passed on; `admin_key` goes with it when given); `status_flag` names the option that chose
    where, for the error when the first Status fails."""
    gen = LoadGenerator(gateway, timeout_s=timeout_s)
    await gen.warm_up(workload, warmup)
    via_gateway = not scheduler
    poller = StatusPoller(scheduler or gateway, poll_s, via_gateway, admin_key, status_flag)
    before = counters_of(await poller.first_status())
    bar = tqdm(
        total=len(workload.requests),
        desc=label,
        unit="req",
        disable=not progress,
        leave=False,
        mininterval=0.5,
    )
    tokens = 0

    def done(record: RequestRecord) -> None:
        nonlocal tokens
        tokens += record.completion_tokens
        bar.update(1)
        bar.set_postfix(
            out_tok_s=f"{tokens / max(1e-9, time.perf_counter() - t0):.0f}", refresh=False
        )

    stop = asyncio.Event()
    gen.prepare(workload)
    t0 = time.perf_counter()
    polling = asyncio.create_task(poller.poll(t0, stop))
    try:
        records = await gen.run(workload, t0, done)
    finally:
        wall = time.perf_counter() - t0
        await asyncio.sleep(poll_s)  # one more period: let the scheduler free the last KV
        stop.set()
        await polling
        bar.close()
    reply = await poller.status()
    await poller.close()
    counters = counter_delta(before, counters_of(reply)) | {"step_model": step_model_errors(reply)}
    return RunResult(
        label, records, poller.samples, wall, counters=counters, sample_period_s=poll_s
    )


def step_model_errors(reply) -> list[dict]:
    """Per worker, its online step-time model's error over its recent steps, as the run ends."""
    return [
        {
            "worker": w.name,
            "error_p50": w.step_time_error_p50,
            "error_p90": w.step_time_error_p90,
            "steps": w.step_time_error_steps,
        }
        for w in reply.workers
    ]


def bench_settings(base: StackSettings, policy: Policy) -> StackSettings:
    """`base` with the policy, fresh loopback ports and queue limits a benchmark never hits."""
    ports = free_ports(2)
    caching = base.prefix_caching if policy.prefix_caching is None else policy.prefix_caching
    return replace(
        base,
        prefix_caching=caching,
        policy=policy.kv,
        mode=policy.mode,
        gateway_port=ports[0],
        scheduler_port=ports[1],
        worker_base_port=free_run(base.workers, ports),
        max_queued_requests=1_000_000,
        max_queued_tokens=2**40,
    )


def run_policy(
    base: StackSettings,
    policy: Policy,
    workload: Workload,
    log_dir: Path,
    progress: bool = True,
    warmup: int = 2,
    poll_s: float = POLL_S,
    timeout_s: float | None = None,
) -> RunResult:
    """Start a stack for `policy`, run `workload` (after `warmup` requests), stop the stack;
    Status every `poll_s`, each request's deadline `timeout_s` (None: none)."""
    settings = bench_settings(base, policy)
    stack = Stack(settings, log_dir / policy.label)
    stack.start()
    try:
        result = asyncio.run(
            run_workload(settings.gateway, settings.scheduler, workload, policy.label, progress,
                         poll_s, warmup=warmup, timeout_s=timeout_s)
        )  # fmt: skip
    finally:
        stack.stop()
    result.config = {
        "policy": policy.label,
        "model": settings.model,
        "dtype": settings.dtype,
        "workers": settings.workers,
        "token_budget": settings.token_budget,
        "max_running": settings.max_running,
        "kv_capacity": settings.kv_capacity,
        "block_size": settings.block_size,
        "chunked_prefill": settings.chunked_prefill,
        "prefix_caching": settings.prefix_caching and settings.policy == "paged",
    }
    return result
