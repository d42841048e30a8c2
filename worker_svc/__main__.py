"""python -m worker_svc: a worker (model + preallocated KV pool) as a plain process."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc
import torch

from llmcommon.auth import internal_token
from llmcommon.server import (
    Server,
    internal_channel,
    run_service,
    serve_metrics,
    setup_logging,
)
from llmcommon.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from worker_svc import blocked_matmul
from worker_svc.cpu_features import host_features
from worker_svc.device import resolve_device
from worker_svc.kernel_plan import plan_kernels, threads_for
from worker_svc.loader import load_model
from worker_svc.memory_profile import pool_positions, profile_blocks
from worker_svc.metrics import WorkerMetrics
from worker_svc.quant import check_quantization
from worker_svc.runner import ModelRunner
from worker_svc.service import WorkerService, forward_thread
from worker_svc.settings import ENV_PREFIX, WorkerSettings
from worker_svc.sim import SimRunner, sim_config

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SIM_CAPACITY = 16384  # --model sim without --kv-capacity: positions of its (imaginary) pool


async def serve(settings: WorkerSettings) -> None:
    log = setup_logging(settings.display_name)
    log.info("settings: %s", dataclasses.asdict(settings))
    token = internal_token(settings.internal_token_file)
    log.info("internal token %s", "required" if token else "off")
    server = Server(
        settings.host,
        settings.port,
        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
        token=token,
    )
    started = time.perf_counter()
    forward = forward_thread()  # loads the model and runs its steps: one OpenMP team
    try:
        runner = await asyncio.get_running_loop().run_in_executor(forward, make_runner, settings)
    except ValueError as err:  # a device that is not there, no room for a pool, a bad model
        raise SystemExit(f"{settings.display_name}: {err}") from None
    service = WorkerService(settings, runner, runner.config.name or settings.model, forward)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server.server)
    info = service.describe()
    log.info(
        "model %s loaded on %s in %.1f s; KV pool %d positions (%d blocks of %d), %.1f MiB, "
        "%d bytes per position",
        info.model,
        info.device,
        time.perf_counter() - started,
        info.capacity_positions,
        info.num_blocks,
        info.block_size,
        info.pool_bytes / 2**20,
        info.bytes_per_position,
    )
    if settings.metrics_port:
        metrics = WorkerMetrics(settings.display_name)
        metrics.attach(service)
        serve_metrics(metrics, settings, log)
    registering: list[asyncio.Task] = []

    async def ready() -> None:
        if settings.scheduler:
            registering.append(asyncio.create_task(register(settings, token, log)))

    async def stop() -> None:
        for task in registering:
            task.cancel()  # a stopping worker takes nothing new: stop announcing it
        await service.drain()

    await server.run(ready, before_stop=stop)


def make_runner(settings: WorkerSettings):
    """The real model, or the simulated one; its context capped by --max-context. Called on
    the forward thread (`forward_thread`): the thread that will run its steps."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.model == "sim":
        config = sim_config()
    else:
        device = resolve_device(settings.device)
        quantization = check_quantization(settings.quantization, device, DTYPES[settings.dtype])
        config, weights = load_model(settings.model, DTYPES[settings.dtype], quantization)
    if settings.max_context:
        config = dataclasses.replace(
            config, max_context=min(config.max_context, settings.max_context)
        )
    if settings.model == "sim":  # nothing computed: no memory to size from
        step, token = settings.sim_step_ms / 1e3, settings.sim_token_us / 1e6
        blocks = settings.num_blocks or SIM_CAPACITY // settings.block_size
        return SimRunner(config, blocks, settings.block_size, step, token)
    dtype = DTYPES[settings.dtype]
    device = resolve_device(settings.device)
    cpu = host_features()
    torch.set_num_threads(threads_for(cpu, settings.threads))
    activations = blocked_matmul.set_activations(settings.int4_activations)
    if activations != settings.int4_activations:
        logging.getLogger("worker").warning(
            "--int4-activations %s: this CPU or kernel build has no VNNI int4 kernel; %s runs",
            settings.int4_activations, activations,
        )  # fmt: skip
    used_before = 0  # device memory other processes hold
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_before = total - free
    tokens = min(settings.profile_tokens, config.max_context)
    blocks = settings.num_blocks or profile_blocks(tokens, settings.block_size)
    runner = ModelRunner(
        config, weights, blocks, settings.block_size, dtype,
        device=device, cuda_graphs=settings.cuda_graphs and device.type == "cuda",
        cache_dtype=settings.kv_cache_dtype,
    )  # fmt: skip
    plan = plan_kernels(runner, cpu, settings.dtype, quantization, settings.quantized_max_rows)
    threads = torch.get_num_threads()
    small = min(settings.small_step_threads or threads, threads)
    small_rows = settings.small_step_rows if small != threads and device.type == "cpu" else 0
    runner.thread_steps(threads, small_rows, small)
    runner.kernel_plan = dataclasses.replace(
        plan, small_step_rows=small_rows, small_step_threads=small if small_rows else 0
    )
    log = logging.getLogger("worker")
    log.info("kernels: %s", runner.kernel_plan.summary())
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu.bf16_native:
        log.warning(
            "this CPU (%s) has no bf16 dot products: bf16 matmuls are converted; --dtype fp32 "
            "may be faster",
            cpu.tier,
        )
    if not settings.num_blocks:
        positions = pool_positions(config, weights, dtype, device, settings, runner, used_before)
        runner.resize_pool(positions // settings.block_size)
    return runner


REFUSED_TOKEN, REFUSED_WORKER = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION


async def register(settings: WorkerSettings, token: str, log, period: float = 2.0) -> None:
    """Announce this worker to the scheduler, again and again: a restarted scheduler (or one
    that started later) learns of it within `period` seconds."""
    request = scheduler_pb2.RegisterRequest(address=settings.address)
    refused = False
    async with internal_channel(settings.scheduler, token) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        while True:
            try:
                reply = await stub.Register(request, timeout=period)
                if reply.joined:
                    log.info(
                        "joined the scheduler at %s as %s", settings.scheduler, settings.address
                    )
            except grpc.aio.AioRpcError as err:
                log.debug("scheduler %s: %s", settings.scheduler, err.code().name)
                # its token, or what this worker describes (another model's vocabulary, ...)
                said_no = err.code() in (REFUSED_TOKEN, REFUSED_WORKER)
                if said_no and not refused:
                    log.error("the scheduler at %s refused: %s", settings.scheduler, err.details())
                refused = said_no
            await asyncio.sleep(period)


def main(argv: list[str] | None = None) -> None:
    run_service("worker_svc", WorkerSettings, ENV_PREFIX, serve, argv)


if __name__ == "__main__":
    main()
