"""python -m gateway: the public gRPC API as a plain process."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal

import grpc

from gateway.admin import GatewayAdmin, GatewayAdminKeyInterceptor, GatewayKeysAdmin
from gateway.api_keys import KeysFileError
from gateway.auth import ApiKeyInterceptor
from gateway.cells import Cells
from gateway.core import GatewayCore
from gateway.inflate import SERVER_OPTIONS
from gateway.key_table import KeyTable
from gateway.malformed import MalformedRequestInterceptor
from gateway.metrics import GatewayMetrics
from gateway.scheduler_watch import CHECK_TIMEOUT_S, WATCH_PERIOD_S, SilenceBound, Verdict
from gateway.served_model import (
    ServedModel,
    first_mismatch,
    model_name,
    resolve,
    tokenizer_source,
)
from gateway.service import GatewayService
from gateway.settings import ENV_PREFIX, GatewaySettings
from gateway.tokenizer_files import load_tokenizer
from llmcommon.admin_auth import AdminKeyInterceptor, admin_key
from llmcommon.auth import internal_token
from llmcommon.health import check_health
from llmcommon.server import Server, internal_channel, run_service, serve_metrics, setup_logging
from llmcommon.v1 import (
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

log = logging.getLogger("gateway")
DESCRIBE_TIMEOUT_S = 5.0  # a worker asked what it serves answers within this
FOLLOW_PERIOD_S = 5.0  # the scheduler's status is read again this often


async def scheduler_status(stub, timeout: float = 180.0) -> scheduler_pb2.StatusReply:
    """The scheduler's status once it has a worker (its context bounds the prompts)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            status = await stub.Status(scheduler_pb2.StatusRequest(), timeout=2.0)
            if status.max_context > 0:
                return status
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.UNAUTHENTICATED:
                raise SystemExit(f"the scheduler refused this gateway: {err.details()}") from None
        if asyncio.get_running_loop().time() > deadline:
            raise SystemExit("the scheduler did not answer with a worker") from None
        await asyncio.sleep(0.2)


async def describe(address: str, token: str) -> worker_pb2.WorkerInfo | None:
    """A worker's own account of its model; None (logged) when it cannot be asked."""
    try:
        async with internal_channel(address, token) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            return await stub.Describe(worker_pb2.DescribeRequest(), timeout=DESCRIBE_TIMEOUT_S)
    except grpc.aio.AioRpcError as err:
        log.warning("worker %s did not describe its model (%s)", address, err.code().name)
        return None


async def served_models(status: scheduler_pb2.StatusReply, token: str) -> list[ServedModel]:
    """What the healthy workers serve: the scheduler says where they are and the model's name;
    each worker, its vocabulary (one that cannot be asked counts by the name alone)."""
    served = []
    for worker in status.workers:
        if worker.healthy:
            info = await describe(worker.address, token)
            if info is None:
                served.append(ServedModel(status.model))
            else:
                eos = tuple(info.eos_token_ids)
                served.append(ServedModel(info.model, info.vocab_size, eos))
    return served or [ServedModel(status.model)]


async def follow_workers(stub, core: GatewayCore, server: Server, token: str) -> None:
    """Workers come and go: keep the prompt limit at the largest context of the live ones, the
    model's name at theirs, and serve only while they serve this gateway's model."""
    seen: list[tuple[str, str]] = []
    while True:
        await asyncio.sleep(FOLLOW_PERIOD_S)
        try:
            status = await stub.Status(scheduler_pb2.StatusRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            continue
        if status.max_context > 0:
            core.max_context, core.model = status.max_context, status.model
        workers = sorted((w.name, w.address) for w in status.workers if w.healthy)
        if not workers or workers == seen:
            continue
        seen = workers
        served = await served_models(status, token)
        problem = first_mismatch(core.model_name, core.tokenizer.vocab_size, served)
        if problem != core.refusal:
            core.refusal = problem
            if problem:
                log.error("NOT_SERVING: %s", problem)
            else:
                log.info("the workers serve this gateway's model again: SERVING")
            if not server.stopping.is_set():
                await server.set_serving(problem is None and core.scheduler_hung is None)


async def watch_scheduler(channel, core: GatewayCore, server: Server) -> None:
    """The gateway's own bound on a hung scheduler (gateway/scheduler_watch.py): NOT_SERVING
    and new requests refused after --scheduler-timeout without an answer, the held requests
    ended after --resubmit-timeout; SERVING again once it answers."""
    s = core.settings
    bound = SilenceBound(s.scheduler_timeout, s.resubmit_timeout)
    while True:
        await asyncio.sleep(WATCH_PERIOD_S)
        asked = bound.clock()
        try:
            await check_health(channel, timeout=CHECK_TIMEOUT_S)
            silent = False
        except grpc.aio.AioRpcError as err:  # UNAVAILABLE: down, which resubmission bounds
            silent = err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        was, verdict = bound.verdict, bound.observe(silent, asked)
        if verdict is Verdict.ANSWERS:
            if was is not Verdict.ANSWERS:
                log.info("the scheduler answers again: SERVING")
                core.scheduler_hung = None
                if not server.stopping.is_set():
                    await server.set_serving(core.refusal is None)
            continue
        core.scheduler_hung = bound.problem()
        if was is Verdict.ANSWERS:
            log.error("NOT_SERVING: %s", core.scheduler_hung)
            if not server.stopping.is_set():
                await server.set_serving(False)
        if verdict is Verdict.GIVEN_UP and core.held:
            log.error("ending %d requests: %s", len(core.held), core.scheduler_hung)
            core.give_up_on_scheduler(core.scheduler_hung)


async def serve(settings: GatewaySettings) -> None:
    log = setup_logging("gateway")
    log.info("settings: %s", dataclasses.asdict(settings))  # the key itself is never logged
    keys = KeyTable(settings)  # SystemExit naming the file and line of a bad one
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_on_hangup, keys)
    if settings.api_keys_file and os.environ.get("LLMSERVE_API_KEY"):
        log.warning("$LLMSERVE_API_KEY is ignored: --api-keys-file names the keys")
    token = internal_token(settings.internal_token_file)
    key = admin_key(settings.admin_key_file)
    metrics = GatewayMetrics() if settings.metrics_port else None
    interceptors = (metrics.interceptors() if metrics else []) + (  # metrics see refusals too
        [ApiKeyInterceptor(keys)] if keys().required else []
    )
    interceptors.append(AdminKeyInterceptor(key))  # the Admin service, forwarded
    interceptors.append(GatewayAdminKeyInterceptor(key))  # the gateway's own admin calls
    interceptors.append(MalformedRequestInterceptor(settings.max_request_bytes))  # innermost
    server = Server(
        settings.host,
        settings.port,
        [
            gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,
            scheduler_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
            gateway_pb2.DESCRIPTOR.services_by_name["GatewayAdmin"].full_name,
        ],
        interceptors=interceptors,
        tls=settings.tls,
        max_message_bytes=settings.max_request_bytes,
        extra_options=SERVER_OPTIONS,  # requests are inflated by MalformedRequestInterceptor
    )
    http_socket = None
    if settings.http_port:  # starlette and uvicorn only with the HTTP API (a GPU check has none)
        from gateway.http_server import bind

        http_socket = bind(settings.host, settings.http_port)
    log.info(
        "API keys: %s; admin key %s; TLS %s; internal token %s",
        keys.summary(),
        "required" if key else "off (the Admin service refuses every call)",
        "on" if settings.tls else "off",
        "sent to the scheduler" if token else "off",
    )
    cells = None
    if settings.cells:  # several cells: the first answers for the model and the context
        cells = Cells(
            settings.cells,
            settings.router_settings(),
            lambda address: internal_channel(address, token),
            settings.scheduler_streams == "session",
            hung_after=settings.scheduler_timeout,
        )
        channel, stub = cells.first().channel, cells
        log.info("cells: %s; router %s", ", ".join(cells.cells), settings.router)
        refused = await cells.refusals()  # a wrong token is a mistake to name, not an outage
        if refused:
            raise SystemExit(f"a cell refused this gateway: {'; '.join(refused)}")
    else:
        channel = internal_channel(settings.scheduler, token)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
    status = await scheduler_status(stub)
    log.info("scheduler: model %s, context %d", status.model, status.max_context)
    if cells is not None and status.block_size:
        cells.router.configure(settings.router_settings(status.block_size))
    source = resolve(settings.model, status.model)
    try:
        tokenizer = load_tokenizer(tokenizer_source(source))
    except (OSError, ValueError) as err:  # no such file, no tokenizer.json, not a GGUF
        raise SystemExit(f"cannot read the tokenizer of --model {source}: {err}") from None
    name = model_name(source)
    problem = first_mismatch(name, tokenizer.vocab_size, await served_models(status, token))
    if problem:
        raise SystemExit(f"the gateway cannot serve these workers: {problem}")
    log.info("model %s (--model %s): %d tokens", name, source, tokenizer.vocab_size)
    core = GatewayCore(
        settings, tokenizer, stub, status.max_context, status.model, name, keys, cells
    )
    if cells is not None:
        cells.on_hung = core.abandon_cell
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayService(core), server.server)
    if cells is None:
        admin = GatewayAdmin(scheduler_pb2_grpc.AdminStub(channel))
    else:  # the router's settings live here; the schedulers' go to every cell
        others = [scheduler_pb2_grpc.AdminStub(c.channel) for c in list(cells.cells.values())[1:]]
        admin = GatewayAdmin(scheduler_pb2_grpc.AdminStub(channel), cells.router, others)
    scheduler_pb2_grpc.add_AdminServicer_to_server(admin, server.server)
    gateway_pb2_grpc.add_GatewayAdminServicer_to_server(GatewayKeysAdmin(keys), server.server)
    if metrics:
        metrics.attach(core)
        serve_metrics(metrics, settings, log)
    follower = asyncio.create_task(follow_workers(stub, core, server, token))
    if cells is None:
        watcher = asyncio.create_task(watch_scheduler(channel, core, server))
    else:  # a cell that dies or hangs is routed around (gateway/cells.py)
        watcher = asyncio.create_task(cells.watch())
    http = None
    if http_socket is not None:
        from gateway.http_api import HttpApi
        from gateway.http_server import HttpServer

        api = HttpApi(
            core, metrics, settings.max_request_bytes, lambda: not server.stopping.is_set()
        )
        http = HttpServer(api.app(), settings)
        http.start(http_socket)
    try:  # on SIGTERM the HTTP API drains beside the gRPC calls
        await server.run(grace=settings.drain_timeout, before_stop=http.drain if http else None)
    finally:
        follower.cancel()
        watcher.cancel()
        if http is not None:
            await http.stopped()


def reload_on_hangup(keys: KeyTable) -> None:
    """SIGHUP: the keys file read again; a bad one is logged and the keys in force stay."""
    try:
        keys.reload()
    except KeysFileError:
        pass  # logged by reload


def main(argv: list[str] | None = None) -> None:
    run_service("gateway", GatewaySettings, ENV_PREFIX, serve, argv)


if __name__ == "__main__":
    main()
