"""python -m scheduler_svc: the scheduler service as a plain process."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

import grpc

from llmserve.auth import INTERNAL_TOKEN_HELP, internal_token
from llmserve.flags import add_flags, from_args
from llmserve.server import Server, die_with_parent, setup_logging
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.workers import WorkerClient

HELP = {
    "workers": "comma-separated worker addresses, or dns:NAME:PORT for every address NAME "
    "resolves to (a headless Service); more may join by registering (worker --scheduler)",
    "discovery_interval": "seconds between lookups of the dns: entries of --workers",
    "overlap": "plan and send each worker's next step while its current one runs",
    "stream_interval_ms": "gather token events this long before sending them (0 = every step)",
    "policy": "KV allocation: reserve prompt+max_tokens at admission, or paged as it grows",
    "mode": "continuous batching, or static (the baseline)",
    "prefix_caching": "reuse the KV blocks of prompt prefixes computed before (paged only: "
    "reserve sets aside whole requests, so it leaves it off)",
    "token_budget": "new tokens processed in one execution, per worker",
    "max_running": "running requests per worker",
    "kv_capacity": "expected KV positions per worker, checked against the workers' reports",
    "hang_floor": "a worker whose step answer or health check is missing this long (at least) "
    "is hung: failed, its requests recomputed elsewhere",
    "hang_factor": "... or this many times its slowest step so far, if longer",
    "execute_timeout": "the longest a step may take, whatever the hang bound",
    "drain_timeout": "on SIGTERM: seconds for the requests in flight to finish",
    "internal_token_file": INTERNAL_TOKEN_HELP,
}


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
    parser = add_flags(argparse.ArgumentParser(prog="scheduler_svc"), SchedulerSettings, HELP)
    asyncio.run(serve(from_args(SchedulerSettings, parser.parse_args(argv))))


if __name__ == "__main__":
    main()
