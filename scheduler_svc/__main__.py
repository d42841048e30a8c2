"""python -m scheduler_svc: the scheduler service as a plain process."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from llmcommon.admin_auth import AdminKeyInterceptor, admin_key
from llmcommon.auth import internal_token
from llmcommon.server import Server, run_service, serve_metrics, setup_logging
from llmcommon.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import ENV_PREFIX, SchedulerSettings
from scheduler_svc.worker_client import WorkerClient, join_problem

SERVICES = ("Scheduler", "Admin")
JOIN_GRACE_S = 3.0  # once a listed worker answers, the others get this long to answer too


class Refused(Exception):
    """A worker refused the internal token: the start stops, once every describe has ended
    (a SystemExit inside a gathered task would leave the others' results unread)."""


async def describe_once(client: WorkerClient) -> str:
    """Why the worker did not describe itself ("" = it did); Refused for a refused token."""
    try:
        await client.describe(timeout=2.0)
        return ""
    except grpc.aio.AioRpcError as err:
        if err.code() is grpc.StatusCode.UNAUTHENTICATED:
            raise Refused(f"worker {client.target}: {err.details()}") from None
        return err.details() or err.code().name


async def connect(
    settings: SchedulerSettings, token: str = "", timeout: float = 120.0
) -> tuple[list[WorkerClient], list[WorkerClient]]:
    """The workers of --workers: (those that answer, those that do not). It waits up to
    `timeout` for one to answer, then JOIN_GRACE_S at most for the rest: the scheduler serves
    with the workers that answer (a restarted one must not wait for a worker that is down),
    and the others join when they answer (Supervisor.join_absent)."""
    clients = [WorkerClient(t, token=token) for t in settings.worker_targets]
    loop = asyncio.get_running_loop()
    deadline, grace_end = loop.time() + timeout, None
    why: dict[WorkerClient, str] = dict.fromkeys(clients, "not asked yet")
    while why:
        asked = list(why)
        answers = await asyncio.gather(*map(describe_once, asked), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, Refused):
                raise SystemExit(str(answer))
            if isinstance(answer, BaseException):
                raise answer
        for client, problem in zip(asked, answers, strict=True):
            if problem:
                why[client] = problem
                continue
            del why[client]
            mismatch = settings.capacity_problem(client.info.capacity_positions)
            if mismatch:
                raise SystemExit(f"worker {client.target} {mismatch}")
        now = loop.time()
        if len(why) < len(clients):
            grace_end = grace_end or now + JOIN_GRACE_S
        if why and grace_end is not None and now >= grace_end:
            break
        if why and grace_end is None and now > deadline:
            client, problem = next(iter(why.items()))
            raise SystemExit(f"worker {client.target} did not answer: {problem}")
        if why:
            await asyncio.sleep(0.2)
    answered = [c for c in clients if c not in why]
    for i, client in enumerate(answered):  # a name listed twice, or another model among them
        problem = join_problem(client.info, [(c.target, c.info, True) for c in answered[:i]])
        if problem:
            raise SystemExit(f"worker {client.target} describes {problem}")
    return answered, list(why)


async def serve(settings: SchedulerSettings) -> None:
    log = setup_logging("scheduler")
    log.info("settings: %s", dataclasses.asdict(settings))
    token = internal_token(settings.internal_token_file)
    log.info("internal token %s", "required and sent to the workers" if token else "off")
    key = admin_key(settings.admin_key_file)
    log.info("admin key %s", "required" if key else "off: the Admin service refuses every call")
    log.info("live settings start from the flags (changes made at run time are not kept)")
    server = Server(
        settings.host,
        settings.port,
        [scheduler_pb2.DESCRIPTOR.services_by_name[name].full_name for name in SERVICES],
        interceptors=[AdminKeyInterceptor(key)],
        token=token,
    )
    clients, absent = await connect(settings, token)
    for c in clients:
        log.info("worker %s: %s", c.target, str(c.info).replace("\n", " "))
    for c in absent:
        log.warning("worker %s does not answer: serving without it until it does", c.target)
    service = SchedulerService(settings, clients, token, absent, admin_key=key)
    service.stopping = server.stopping  # set at SIGTERM: new submissions are refused
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server.server)
    scheduler_pb2_grpc.add_AdminServicer_to_server(service.admin, server.server)

    async def ready() -> None:
        service.start()
        if settings.metrics_port:
            metrics = SchedulerMetrics()
            metrics.attach(service)
            serve_metrics(metrics, settings, log)

    await server.run(ready, grace=settings.drain_timeout)


def main(argv: list[str] | None = None) -> None:
    run_service("scheduler_svc", SchedulerSettings, ENV_PREFIX, serve, argv)


if __name__ == "__main__":
    main()
