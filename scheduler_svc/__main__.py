"""python -m scheduler_svc: the scheduler service as a plain process."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

import grpc

from llmserve.runtime.auth import internal_token
from llmserve.runtime.flags import add_flags, from_args
from llmserve.runtime.server import Server, die_with_parent, setup_logging
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import ENV_PREFIX, SchedulerSettings
from scheduler_svc.workers import WorkerClient


async def connect(
    settings: SchedulerSettings, token: str = "", timeout: float = 120.0
) -> list[WorkerClient]:
    clients = [WorkerClient(t, token=token) for t in settings.worker_targets]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for client in clients:
        while True:
            try:
                await client.describe(timeout=2.0)
                break
            except grpc.aio.AioRpcError as err:
                if err.code() is grpc.StatusCode.UNAUTHENTICATED:
                    raise SystemExit(f"worker {client.target}: {err.details()}") from None
                if loop.time() > deadline:
                    raise SystemExit(
                        f"worker {client.target} did not answer: {err.details()}"
                    ) from None
                await asyncio.sleep(0.2)
        capacity = client.info.capacity_positions
        if settings.kv_capacity and capacity != settings.kv_capacity:
            raise SystemExit(
                f"worker {client.target} reports a KV pool of {capacity} positions, "
                f"but --kv-capacity is {settings.kv_capacity}"
            )
    return clients


async def serve(settings: SchedulerSettings) -> None:
    log = setup_logging("scheduler")
    log.info("settings: %s", dataclasses.asdict(settings))
    token = internal_token(settings.internal_token_file)
    log.info("internal token %s", "required and sent to the workers" if token else "off")
    server = Server(
        settings.host,
        settings.port,
        [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name],
        token=token,
    )
    clients = await connect(settings, token)
    for c in clients:
        log.info("worker %s: %s", c.target, str(c.info).replace("\n", " "))
    service = SchedulerService(settings, clients, token)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server.server)

    async def ready() -> None:
        service.start()
        if settings.metrics_port:
            metrics = SchedulerMetrics()
            metrics.attach(service)
            metrics.serve(settings.host, settings.metrics_port)
            log.info("metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)

    await server.run(ready, grace=settings.drain_timeout)


def main(argv: list[str] | None = None) -> None:
    die_with_parent()  # when started by `llmserve up`
    parser = argparse.ArgumentParser(prog="scheduler_svc")
    add_flags(parser, SchedulerSettings, env_prefix=ENV_PREFIX)
    asyncio.run(serve(from_args(SchedulerSettings, parser.parse_args(argv))))


if __name__ == "__main__":
    main()
