"""The scheduler service: gRPC in front of the pure core, one step loop per worker, and the
worker set as workers join, fail, come back and leave."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid

import grpc

from llmserve.runtime.protocol import ACCEPTED_KEY
from llmserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from scheduler_svc.core import Scheduler
from scheduler_svc.invariants import ENV_VAR, check_invariants, check_step
from scheduler_svc.output import Refused
from scheduler_svc.reasons import RefusalReason
from scheduler_svc.relay import EventRelay
from scheduler_svc.run_clock import RunClock
from scheduler_svc.sequence import SeqStatus, Sequence
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.step import Step
from scheduler_svc.step_times import StepTimes
from scheduler_svc.submit_checks import submit_problem
from scheduler_svc.worker_client import WorkerClient
from scheduler_svc.worker_loop import WorkerLoop

log = logging.getLogger("scheduler")
FORGET_AFTER_S = 30.0  # a registered worker unreachable this long leaves the stack

REFUSED_CODE = {  # one for every RefusalReason (a test checks)
    RefusalReason.CONTEXT: grpc.StatusCode.INVALID_ARGUMENT,
    RefusalReason.KV_CAPACITY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RefusalReason.TOKEN_BUDGET: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RefusalReason.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    RefusalReason.NO_WORKER: grpc.StatusCode.UNAVAILABLE,
}


class TokenMismatch(Exception):
    """A worker refused the scheduler's internal token."""


def work_sampling(s: common_pb2.SamplingParams) -> worker_pb2.WorkSampling:
    """The worker's sampling settings of a request (stop_token_ids are added by the caller)."""
    return worker_pb2.WorkSampling(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        logit_bias=s.logit_bias,
        min_tokens=s.min_tokens,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        grammar=s.grammar if s.HasField("grammar") else None,  # structured output, as sent
    )


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        settings: SchedulerSettings,
        clients: list[WorkerClient],
        token: str = "",
        absent: list[WorkerClient] | None = None,
    ) -> None:
        self.settings = settings
        self.token = token  # the internal token, sent to the workers that join
        self.clients: list[WorkerClient] = []
        self.absent = list(absent or [])  # in --workers, not answering yet: see join_absent
        self.loops: list[WorkerLoop | None] = []
        self.core = Scheduler(settings.core())
        self.eos_ids: frozenset[int] = frozenset()
        self.streams: dict[str, asyncio.Queue[scheduler_pb2.TokenEvent]] = {}
        self.times = StepTimes()
        self.clock = RunClock()  # the scheduler's own running time: how late a worker is
        self.check_every_step = os.environ.get(ENV_VAR, "") not in ("", "0")
        if self.check_every_step:
            log.warning("%s is set: checking the core's invariants after every step", ENV_VAR)
        self.on_step = None  # metrics hook: (worker index, step, forward seconds) per execution
        self.on_join = None  # metrics hook: (worker name) when a worker joins
        self.relay = EventRelay(self.streams, settings.stream_interval_ms / 1e3)
        self.started = False
        for client in clients:
            self.join(client)

    # ---- the worker set ------------------------------------------------------------------

    def join(self, client: WorkerClient) -> int:
        """A described worker joins the stack and gets admissions from its first step."""
        index = self.core.add_worker(client.spec())
        self.clients.append(client)
        self.loops.append(None)
        if not self.eos_ids and client.info is not None:
            self.eos_ids = frozenset(client.info.eos_token_ids)
        if self.on_join is not None:
            self.on_join(client.spec().name)
        if self.started:
            self.start_loop(index)
        return index

    def start_loop(self, index: int) -> None:
        loop = self.loops[index] = WorkerLoop(self, index, self.clients[index])
        loop.start()
        self.wake_all()

    def worker_lost(self, index: int, err: BaseException) -> None:
        """Its stream ended. Holding nothing, a drained worker, or one that joined by itself,
        has left (it is welcome back); otherwise it failed: its requests are recomputed
        elsewhere, and a fixed --workers address stays listed, unhealthy, until it returns."""
        ws = self.core.workers[index]
        if not any(s.status is SeqStatus.RUNNING for s in ws.running) and (
            ws.draining or not self.clients[index].static
        ):
            log.info("worker %s has left (%s)", ws.spec.name, err)
            self.core.remove_worker(index)
        else:
            log.error("worker %s failed: %s; re-queueing its requests", ws.spec.name, err)
            self.core.fail_worker(index)
        self.clients[index].unreachable_since = time.monotonic()
        self.workers_changed()

    def workers_changed(self) -> None:
        """The live workers changed: what none of them can hold fails now (no loop may be left
        to notice); the rest may have a new place."""
        self.core.fail_unplaceable()
        self.dispatch(self.core.take_raw_events())
        self.wake_all()

    async def Register(self, request, context):
        address = request.address.strip()
        if not address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "register needs an address")
        known = [i for i, c in enumerate(self.clients) if c.target == address]
        if known:  # a departed worker is back; a failed one is the watcher's (try_restore)
            gone = self.core.workers[known[0]].gone
            if gone:
                await self.try_restore(known[0])
            return scheduler_pb2.RegisterReply(joined=gone and not self.core.workers[known[0]].gone)
        try:
            added = await self.add_address(address)
        except TokenMismatch:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the worker at {address} refuses this scheduler's internal token: give both "
                f"the same --internal-token-file",
            )
        if not added:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cannot reach the worker at {address}: check its --advertise address",
            )
        return scheduler_pb2.RegisterReply(joined=True)

    # ---- gRPC handlers -------------------------------------------------------------------

    async def Submit(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        s = request.sampling
        prompt, resumed = list(request.prompt_token_ids), list(request.resume_token_ids)
        problem = submit_problem(prompt, resumed, s, self.vocab_size())
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        seq = Sequence(
            request_id=rid,
            prompt_ids=prompt,
            output_ids=resumed,
            max_tokens=s.max_tokens,
            ignore_eos=s.ignore_eos,
            sampling=work_sampling(s),
            cache_salt=request.cache_salt,
        )
        seq.eos_ids = self.eos_ids
        seq.stop_ids = (frozenset() if seq.ignore_eos else self.eos_ids) | set(s.stop_token_ids)
        seq.sampling.stop_token_ids.extend(sorted(seq.stop_ids))  # masked under min_tokens
        if resumed and resumed[-1] in seq.stop_ids:  # it had ended; only the news was lost
            yield scheduler_pb2.TokenEvent(finish_reason=common_pb2.FINISH_REASON_STOP)
            return
        try:
            self.core.add(seq)
        except Refused as refused:
            await context.abort(REFUSED_CODE[refused.reason], str(refused))
        queue: asyncio.Queue[scheduler_pb2.TokenEvent] = asyncio.Queue()
        self.streams[rid] = queue
        self.wake_all()
        await context.send_initial_metadata(((ACCEPTED_KEY, "1"),))
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                yield event
        finally:
            self.streams.pop(rid, None)
            if not finished and self.core.abort(rid):
                self.wake_all()  # the client went away: free its KV at the next step

    def vocab_size(self) -> int:
        """Token ids must be below every live worker's vocabulary (0 = none has said)."""
        workers = zip(self.clients, self.core.workers, strict=True)
        sizes = [
            c.info.vocab_size for c, ws in workers if not ws.gone and c.info and c.info.vocab_size
        ]
        return min(sizes, default=0)

    async def Cancel(self, request, context):
        found = self.core.abort(request.request_id)
        self.dispatch(self.core.take_raw_events())
        self.wake_all()
        return scheduler_pb2.CancelReply(found=found)

    async def Status(self, request, context):
        snap = self.core.snapshot()
        cfg = self.core.config
        reply = scheduler_pb2.StatusReply(
            policy=cfg.policy.value,
            mode=cfg.mode.value,
            token_budget=cfg.token_budget,
            max_running=cfg.max_running,
            block_size=max((w.block_size for w in snap.workers), default=0),
            chunked_prefill=cfg.chunked_prefill,
            steps=snap.steps,
            waiting=snap.waiting,
            waiting_tokens=snap.waiting_tokens,
            running=snap.running,
            head_wait_reason=snap.head_wait_reason,
            admitted=snap.admitted,
            finished=snap.finished,
            preemptions=snap.preemptions,
            oldest_wait_s=snap.oldest_wait,
            max_context=max((w.max_context for w in snap.workers if w.healthy), default=0),
            model=self.clients[0].info.model if self.clients and self.clients[0].info else "",
            executed_steps=self.times.executed_steps,
            step_seconds=self.times.step_seconds,
            forward_seconds=self.times.forward_seconds,
            core_seconds=self.times.core_seconds,
            overlap=self.settings.overlap,
            generated_tokens=self.core.generated,
            prefix_caching=self.core.caching,
            prompt_tokens=sum(kv.prompt_tokens for kv in snap.workers),
            hit_tokens=sum(kv.hit_tokens for kv in snap.workers),
            evictions=sum(kv.evictions for kv in snap.workers),
        )
        reply.stalls.update(snap.stalls)
        reply.refused.update(snap.refused)
        clients = {c.spec().name: c for c in self.clients if c.info is not None}
        for kv in snap.workers:
            client = clients.get(kv.name)
            out = reply.workers.add(
                name=kv.name,
                capacity=kv.capacity,
                written=kv.written,
                reserved_unwritten=kv.reserved_unwritten,
                free=kv.free,
                running=kv.running,
                healthy=kv.healthy,
                draining=kv.draining,
                block_size=kv.block_size,
                max_context=kv.max_context,
                steps=kv.steps,
                cached_blocks=kv.cached_blocks,
                evictable_blocks=kv.evictable_blocks,
                evictions=kv.evictions,
                prompt_tokens=kv.prompt_tokens,
                hit_tokens=kv.hit_tokens,
            )
            out.stalls.update(kv.stalls)
            if client is not None:
                out.address = client.target
                out.forward_seconds = client.forward_seconds
                out.idle_seconds = client.idle_seconds
                out.step_bytes = client.step_bytes
                out.kernels = client.info.kernels  # the worker's pick for its host
        return reply

    # ---- the step loops -------------------------------------------------------------------

    def start(self) -> None:
        self.started = True
        self.clock_task = asyncio.create_task(self.clock.tick(), name="run-clock")
        self.clock_task.add_done_callback(self.died)
        for index, ws in enumerate(self.core.workers):
            if ws.healthy:
                self.start_loop(index)
        self.watch_task = asyncio.create_task(self.watch_workers())
        self.watch_task.add_done_callback(self.died)
        if self.settings.dns_names:
            self.discover_task = asyncio.create_task(self.discover())
            self.discover_task.add_done_callback(self.died)

    def died(self, task: asyncio.Task) -> None:
        """A crashed loop would leave requests hanging: exit, so clients see UNAVAILABLE and a
        supervisor can restart the scheduler."""
        if task.cancelled() or task.exception() is None:
            return
        err = task.exception()
        log.critical("%s crashed; exiting", task.get_name(), exc_info=err)
        os._exit(70)  # log records are flushed as written

    def check(self, planned: Step | None = None) -> None:
        if self.check_every_step:  # raises InvariantError: the loop crashes, see died
            check_invariants(self.core)
            if planned is not None:
                check_step(self.core, planned)

    def after_plan(self, step: Step) -> None:
        self.check(step)
        for index in self.core.take_wakes():
            loop = self.loops[index]
            if loop is not None:
                loop.wake.set()
        if self.core.outbox:  # admissions, and requests no worker can hold
            self.dispatch(self.core.take_raw_events())

    def wake_all(self) -> None:
        for loop in self.loops:
            if loop is not None:
                loop.wake.set()

    async def watch_workers(self, period: float = 0.25) -> None:
        """Drain a worker whose health turns NOT_SERVING (it is stopping); bring a failed or
        departed worker back once it answers Describe again (a replacement may bring another
        pool); forget a registered one that stays away."""
        while True:
            await asyncio.sleep(period)
            watched = (self.watch(i) for i in range(len(self.core.workers)))
            await asyncio.gather(*watched, *map(self.join_absent, list(self.absent)))

    async def join_absent(self, client: WorkerClient) -> None:
        """A worker of --workers that did not answer at the start joins once it does."""
        try:
            await client.describe(timeout=1.0)
        except grpc.aio.AioRpcError:
            return
        self.absent.remove(client)
        problem = self.settings.capacity_problem(client.info.capacity_positions)
        if problem or any(c.target == client.target for c in self.clients):
            log.error("worker %s %s: it stays out", client.target, problem or "joined already")
            await client.close()
            return
        log.info("worker %s joined: %s", client.target, str(client.info).replace("\n", " "))
        self.join(client)

    async def watch(self, index: int) -> None:
        """One worker's health: a live one that says NOT_SERVING drains; one that does not
        answer for longer than its hang bound is failed (a hung process keeps its stream open);
        a failed or departed one is brought back when it answers again."""
        ws, client = self.core.workers[index], self.clients[index]
        if not ws.healthy:
            if not ws.gone or client.static:  # a registered worker comes back by registering
                await self.try_restore(index)
            return
        serving = await client.serving()
        now = self.clock.now()  # silence counts only while the scheduler itself runs
        if serving is None:
            client.silent_since = client.silent_since or now
            loop = self.loops[index]
            if loop is not None and now - client.silent_since > loop.hang_bound():
                loop.fail(f"no answer to health checks for {now - client.silent_since:.1f} s")
            return
        client.silent_since = None
        if serving is False and not ws.draining:
            log.info("worker %s is stopping: draining it", ws.spec.name)
            self.core.drain_worker(index)
            self.workers_changed()

    async def discover(self) -> None:
        """Resolve each dns: name again and again; an address not seen before joins. (An
        address that disappears is a worker that left: its stream ends, see worker_lost.)"""
        loop = asyncio.get_running_loop()
        while True:
            for host, port in self.settings.dns_names:
                try:
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                except OSError as err:
                    log.warning("cannot resolve %s: %s", host, err)
                    continue
                for info in infos:
                    ip = info[4][0]
                    with contextlib.suppress(TokenMismatch):  # logged; it stays out
                        await self.add_address(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
            await asyncio.sleep(self.settings.discovery_interval)

    async def add_address(self, address: str) -> bool:
        """Describe the worker at `address` and let it join; False if it is known already or
        does not answer. A departed one that answers again comes back."""
        for index, client in enumerate(self.clients):
            if client.target == address:
                if self.core.workers[index].gone:
                    await self.try_restore(index)
                return False
        client = WorkerClient(address, static=False, token=self.token)
        try:
            await client.describe(timeout=5.0)
        except grpc.aio.AioRpcError as err:
            await client.close()
            if err.code() is grpc.StatusCode.UNAUTHENTICATED:
                log.error("worker %s refuses this scheduler's internal token", address)
                raise TokenMismatch(address) from None
            log.debug("worker %s does not answer: %s", address, err.code().name)
            return False
        if any(c.target == address for c in self.clients):  # joined while we described it
            await client.close()
            return False
        log.info("worker %s joined: %s", address, str(client.info).replace("\n", " "))
        self.join(client)
        return True

    async def try_restore(self, index: int) -> None:
        ws, client = self.core.workers[index], self.clients[index]
        try:
            await client.describe(timeout=1.0)
        except grpc.aio.AioRpcError:
            since = client.unreachable_since or time.monotonic()
            if not client.static and not ws.gone and time.monotonic() - since > FORGET_AFTER_S:
                log.info("worker %s stayed away: it leaves the stack", ws.spec.name)
                self.core.remove_worker(index)
            return
        if await client.serving() is not True:
            return  # answering, but not (yet, or any more) taking work
        log.info("worker %s is back", ws.spec.name)
        self.core.restore_worker(index, client.spec())
        client.unreachable_since = client.silent_since = None
        self.start_loop(index)

    # ---- events to the request streams ---------------------------------------------------

    def dispatch(self, events: list) -> None:
        if events:
            self.relay.dispatch(events)
