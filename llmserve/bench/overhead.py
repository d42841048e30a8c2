"""`llmserve bench overhead`: what the control plane costs at GPU-class step times.

The real gateway, scheduler and N workers run as processes with the simulated model (each
execution sleeps a set time, no computation), under a closed loop of streaming clients. Per
configuration: the workers' busy fraction (time in the forward pass / wall), the time per step
the workers spend outside it (scheduler + gRPC), bytes per step message, output tokens/s."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import grpc

from llmserve import client
from llmserve.bench.prompts import prompt_text
from llmserve.ports import free_ports, free_run
from llmserve.stack import Stack, StackSettings
from llmserve.v1 import gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

PROMPT_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Config:
    step_ms: float
    running: int  # concurrent streams in all
    workers: int
    overlap: bool


@dataclass(slots=True)
class Row:
    step_ms: float
    running: int
    workers: int
    overlap: bool
    busy: float  # forward time / wall, averaged over the workers
    outside_ms: float  # per step, the worker's time outside the forward pass
    core_us: float  # per step, plan() + complete() in the scheduler
    bytes_per_step: float
    tokens_per_s: float
    steps: int


def grid(step_ms: list[float], running: list[int], workers: list[int]) -> list[Config]:
    return [
        Config(s, r, w, o)
        for s, r, w, o in itertools.product(step_ms, running, workers, (True, False))
    ]


def stack_settings(config: Config, max_tokens: int, stream_interval_ms: float) -> StackSettings:
    per_worker = -(-config.running // config.workers)
    ports = free_ports(2)
    return StackSettings(
        model="sim",
        sim_step_ms=config.step_ms,
        workers=config.workers,
        overlap=config.overlap,
        stream_interval_ms=stream_interval_ms,
        token_budget=max(256, per_worker * 2),
        max_running=per_worker,
        kv_capacity=per_worker * 16 * -(-(PROMPT_TOKENS + max_tokens + 32) // 16),
        block_size=16,
        gateway_port=ports[0],
        scheduler_port=ports[1],
        worker_base_port=free_run(config.workers, ports),
        max_queued_requests=config.running * 2,
        default_max_tokens=max_tokens,
    )


class ClosedLoop:
    """`n` streams; each restarts when its request ends, until stopped. Counts tokens."""

    def __init__(self, target: str, n: int, max_tokens: int) -> None:
        self.target, self.n, self.max_tokens = target, n, max_tokens
        self.tokens = 0
        self.errors: list[str] = []
        self.stopping = False

    async def run(self) -> None:
        async with grpc.aio.insecure_channel(target=self.target) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            await asyncio.gather(*(self.stream(stub, i) for i in range(self.n)))

    async def stream(self, stub, i: int) -> None:
        for round_ in itertools.count():
            if self.stopping:
                return
            request = client.make_request(
                prompt=prompt_text(PROMPT_TOKENS),
                max_tokens=self.max_tokens,
                temperature=0.0,
                ignore_eos=True,
                request_id=f"overhead-{i}-{round_}",
            )
            call = stub.Generate(request)
            try:
                async for message in call:
                    self.tokens += len(message.delta.token_ids)
                    if self.stopping:
                        call.cancel()
                        return
            except grpc.aio.AioRpcError as err:
                if not self.stopping:
                    self.errors.append(f"{err.code().name}: {err.details()}")
                    return


async def status(target: str) -> scheduler_pb2.StatusReply:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return await stub.Status(scheduler_pb2.StatusRequest(), timeout=10)


async def measure(settings: StackSettings, running: int, window_s: float, max_tokens: int) -> Row:
    load = ClosedLoop(settings.gateway, running, max_tokens)
    task = asyncio.create_task(load.run())
    try:
        deadline = time.monotonic() + 60
        while (await status(settings.scheduler)).running < running:
            if load.errors or time.monotonic() > deadline:
                raise RuntimeError(f"the load never reached {running} running: {load.errors[:3]}")
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # past the prefills
        before, tokens0, t0 = await status(settings.scheduler), load.tokens, time.monotonic()
        await asyncio.sleep(window_s)
        after, tokens1, t1 = await status(settings.scheduler), load.tokens, time.monotonic()
    finally:
        load.stopping = True
        await asyncio.wait_for(task, 30)
    return row_of(before, after, t1 - t0, tokens1 - tokens0)


def row_of(
    before: scheduler_pb2.StatusReply, after: scheduler_pb2.StatusReply, wall: float, tokens: int
) -> Row:
    old = {w.name: w for w in before.workers}
    busy, outside, steps, sent = [], [], 0, 0
    for w in after.workers:
        b = old[w.name]
        forward, n = w.forward_seconds - b.forward_seconds, w.steps - b.steps
        busy.append(forward / wall)
        outside.append((wall - forward) / max(n, 1))
        steps += n
        sent += w.step_bytes - b.step_bytes
    core = after.core_seconds - before.core_seconds
    return Row(
        step_ms=0.0,
        running=0,
        workers=len(after.workers),
        overlap=after.overlap,
        busy=sum(busy) / len(busy),
        outside_ms=1e3 * sum(outside) / len(outside),
        core_us=1e6 * core / max(steps, 1),
        bytes_per_step=sent / max(steps, 1),
        tokens_per_s=tokens / wall,
        steps=steps,
    )


def run_config(
    config: Config, out: Path, window_s: float, max_tokens: int, stream_interval_ms: float
) -> Row:
    settings = stack_settings(config, max_tokens, stream_interval_ms)
    name = f"{config.step_ms:g}ms-{config.running}r-{config.workers}w-" + (
        "overlap" if config.overlap else "serial"
    )
    with Stack(settings, out / "logs" / name):
        row = asyncio.run(measure(settings, config.running, window_s, max_tokens))
    return replace(row, step_ms=config.step_ms, running=config.running)


def table(rows: list[Row]) -> str:
    head = (
        "| step | running | workers | overlap | worker busy | outside forward / step | "
        "core / step | bytes / step | output tok/s | steps |\n"
        "|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r.step_ms:g} ms | {r.running} | {r.workers} | {'on' if r.overlap else 'off'} | "
            f"{100 * r.busy:.1f}% | {r.outside_ms:.2f} ms | {r.core_us:.0f} µs | "
            f"{r.bytes_per_step:.0f} | {r.tokens_per_s:,.0f} | {r.steps} |"
        )
    return "\n".join(lines)


def rows_json(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
