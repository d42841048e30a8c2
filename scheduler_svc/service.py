"""The scheduler service: gRPC in front of the pure core, and the step loop that drives workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections import defaultdict

import grpc

from llmserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from scheduler_svc.core import Scheduler
from scheduler_svc.invariants import ENV_VAR, check_invariants
from scheduler_svc.plan import Event, Refused, WorkerBatch
from scheduler_svc.sequence import Finish, Sequence
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.step_times import StepTimes
from scheduler_svc.workers import WorkerClient

log = logging.getLogger("scheduler")
UNKNOWN = grpc.StatusCode.UNKNOWN  # what a worker answers when its execution raised
SEND_GRACE_S = 0.002  # how long a step's token events wait for the next step's requests to leave

FINISH_TO_PROTO = {
    Finish.STOP: common_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    Finish.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    Finish.ERROR: common_pb2.FINISH_REASON_ERROR,
}
REFUSED_CODE = {
    "context": grpc.StatusCode.INVALID_ARGUMENT,
    "kv_capacity": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "token_budget": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "duplicate": grpc.StatusCode.ALREADY_EXISTS,
}


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, settings: SchedulerSettings, clients: list[WorkerClient]) -> None:
        self.settings = settings
        self.clients = clients
        self.core = Scheduler(settings.core(), [c.spec() for c in clients])
        self.eos_ids = frozenset(clients[0].info.eos_token_ids) if clients[0].info else frozenset()
        self.streams: dict[str, asyncio.Queue[scheduler_pb2.TokenEvent]] = {}
        self.wake = asyncio.Event()
        self.loop_task: asyncio.Task | None = None
        self.times = StepTimes()
        self.check = os.environ.get(ENV_VAR, "") not in ("", "0")  # debug: check every step
        if self.check:
            log.warning("%s is set: checking the core's invariants after every step", ENV_VAR)
        self.on_step = None  # metrics hook: (batches, seconds executing them) after each step
        self.outbox: list[Event] = []  # events for the streams, handed over in order by _flush
        self.flush_handle: asyncio.TimerHandle | None = None

    # ---- gRPC handlers -------------------------------------------------------------------

    async def Submit(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        s = request.sampling
        seq = Sequence(
            request_id=rid,
            prompt_ids=list(request.prompt_token_ids),
            max_tokens=s.max_tokens,
            eos_ids=self.eos_ids,
            ignore_eos=s.ignore_eos,
            sampling=worker_pb2.WorkSampling(
                temperature=s.temperature if s.HasField("temperature") else 1.0,
                top_p=s.top_p if s.HasField("top_p") else 1.0,
                top_k=s.top_k,
                seed=s.seed if s.HasField("seed") else None,
            ),
        )
        if not any(ws.healthy for ws in self.core.workers):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is available")
        if not seq.prompt_ids or seq.max_tokens < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt or max_tokens < 1")
        try:
            self.core.add(seq)
        except Refused as refused:
            await context.abort(
                REFUSED_CODE.get(refused.reason, grpc.StatusCode.UNKNOWN), str(refused)
            )
        queue: asyncio.Queue[scheduler_pb2.TokenEvent] = asyncio.Queue()
        self.streams[rid] = queue
        self.wake.set()
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                yield event
        finally:
            self.streams.pop(rid, None)
            if not finished and self.core.abort(rid):
                self.wake.set()  # the client went away: free its KV at the next step

    async def Cancel(self, request, context):
        found = self.core.abort(request.request_id)
        self.wake.set()
        return scheduler_pb2.CancelReply(found=found)

    async def Status(self, request, context):
        snap = self.core.snapshot()
        cfg = self.core.config
        reply = scheduler_pb2.StatusReply(
            policy=cfg.policy.value,
            mode=cfg.mode.value,
            token_budget=cfg.token_budget,
            max_running=cfg.max_running,
            block_size=self.core.workers[0].spec.block_size,
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
            max_context=min(ws.spec.max_context for ws in self.core.workers),
            model=self.clients[0].info.model if self.clients[0].info else "",
            executed_steps=self.times.executed_steps,
            step_seconds=self.times.step_seconds,
            forward_seconds=self.times.forward_seconds,
            core_seconds=self.times.core_seconds,
        )
        reply.stalls.update(snap.stalls)
        reply.refused.update(snap.refused)
        for kv in snap.workers:
            reply.workers.append(
                scheduler_pb2.WorkerKv(
                    name=kv.name,
                    capacity=kv.capacity,
                    written=kv.written,
                    reserved_unwritten=kv.reserved_unwritten,
                    free=kv.free,
                    running=kv.running,
                    healthy=kv.healthy,
                    draining=kv.draining,
                )
            )
        return reply

    # ---- the step loop -------------------------------------------------------------------

    def start(self) -> None:
        self.loop_task = asyncio.create_task(self.run_loop())
        self.watch_task = asyncio.create_task(self.watch_workers())
        for task in (self.loop_task, self.watch_task):
            task.add_done_callback(self._died)

    def _died(self, task: asyncio.Task) -> None:
        """A crashed step loop would leave every request hanging: exit, so clients see
        UNAVAILABLE and a supervisor can restart the scheduler."""
        if task.cancelled() or task.exception() is None:
            return
        err = task.exception()
        log.critical("%s crashed; exiting", task.get_coro().__name__, exc_info=err)
        os._exit(70)  # log records are flushed as written

    def _check(self) -> None:
        if self.check:
            check_invariants(self.core)  # raises InvariantError: the loop crashes, see _died

    async def run_loop(self) -> None:
        """One iteration per step. A step's token events are handed to the request streams only
        once the next step's Execute calls are on their way: writing 32 streams takes the event
        loop milliseconds, which would otherwise idle the workers between steps."""
        pending: list[Event] = []  # events not yet handed to the streams
        while True:
            if not self._has_work():
                self._dispatch(pending)
                pending = []
                self.wake.clear()  # before any await: a Submit during the releases sets it again
                await self._send_releases(self.core.take_releases())  # the workers' view too
                await self.wake.wait()
                continue
            started = time.perf_counter()
            batches = self.core.schedule()
            core = time.perf_counter() - started
            self._check()
            pending += self.core.take_events()
            if not any(b.items for b in batches):
                self._dispatch(pending)
                pending = []
                self.wake.clear()  # before any await, as above
                await self._send_releases(batches)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), timeout=0.05)
                continue
            executing = time.perf_counter()
            sampled = await self._execute(batches, pending)
            pending = []
            if self.on_step is not None:
                self.on_step(batches, time.perf_counter() - executing)
            post = time.perf_counter()
            self.core.postprocess(batches, sampled)
            core += time.perf_counter() - post
            self._check()
            pending = self.core.take_events()
            forward = max(self.clients[b.worker].last_forward for b in batches if b.items)
            self.times.add(time.perf_counter() - started, forward, core)

    async def watch_workers(self, period: float = 0.25) -> None:
        """Drain a worker whose health turns NOT_SERVING (it is stopping); bring a failed worker
        back once it answers Describe again with the same pool."""
        while True:
            await asyncio.sleep(period)
            for index, ws in enumerate(self.core.workers):
                if ws.healthy:
                    if not ws.draining and await self.clients[index].serving() is False:
                        log.info("worker %s is stopping: draining it", ws.spec.name)
                        self.core.drain_worker(index)
                    continue
                try:
                    await self.clients[index].describe(timeout=1.0)
                except grpc.aio.AioRpcError:
                    continue
                if self.clients[index].spec() == ws.spec:
                    log.info("worker %s is back", ws.spec.name)
                    self.core.restore_worker(index)
                    self.clients[index].restores += 1  # the worker forgets what it held
                    self.wake.set()

    def _has_work(self) -> bool:
        return bool(self.core.waiting) or any(ws.running for ws in self.core.workers)

    async def _execute(self, batches: list[WorkerBatch], events: list[Event]) -> dict[str, int]:
        """Run one step on the workers; hand `events` to the streams once the calls are sent."""
        step = self.core.steps
        calls = [
            asyncio.ensure_future(
                self.clients[b.worker].execute(step, b, self.settings.execute_timeout)
            )
            for b in batches
        ]
        # The streams' writes (milliseconds of event-loop time for a few dozen requests) wait a
        # moment, so that the requests reach the workers first instead of queueing behind them.
        last = max(self.clients[b.worker].last_forward for b in batches)
        self._dispatch(events, delay=min(SEND_GRACE_S, last / 4))
        results = await asyncio.gather(*calls, return_exceptions=True)
        sampled: dict[str, int] = {}
        for batch, result in zip(batches, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError) and result.code() is UNKNOWN:
                self._batch_failed(batch, result)
            elif isinstance(result, BaseException):
                self._worker_failed(batch.worker, result)
            else:
                sampled.update(result)
        return sampled

    async def _send_releases(self, batches: list[WorkerBatch]) -> None:
        for batch in batches:
            try:
                await self.clients[batch.worker].execute(self.core.steps, batch, 10.0)
            except grpc.aio.AioRpcError as err:
                self._worker_failed(batch.worker, err)

    def _worker_failed(self, index: int, err: BaseException) -> None:
        name = self.core.workers[index].spec.name
        log.error("worker %s failed: %s; re-queueing its requests", name, err)
        moved = self.core.fail_worker(index)
        if not any(ws.healthy for ws in self.core.workers):
            for seq in moved + list(self.core.waiting):
                self.core.abort(seq.request_id, Finish.ERROR, "no worker available")

    def _batch_failed(self, batch: WorkerBatch, err: grpc.aio.AioRpcError) -> None:
        """The worker answered, but its execution raised: fail this batch's requests and keep the
        worker. Re-queueing them would carry a request that breaks the model to every worker."""
        name = self.core.workers[batch.worker].spec.name
        log.error(
            "worker %s failed to execute a batch of %d requests: %s; failing them",
            name,
            len(batch.items),
            err.details(),
        )
        for work in batch.items:
            self.core.abort(
                work.seq.request_id,
                Finish.ERROR,
                f"the model failed on this request's batch on {name} (see its log)",
            )

    def _dispatch(self, events: list[Event], delay: float = 0.0) -> None:
        """Queue events for their streams; hand them over now, or after `delay` seconds. Events
        always reach the streams in the order they were queued (a later immediate dispatch
        first hands over the delayed ones), so no finish overtakes a token."""
        self.outbox.extend(events)
        if delay <= 0.0:
            self._flush()
        elif self.flush_handle is None and self.outbox:
            self.flush_handle = asyncio.get_running_loop().call_later(delay, self._flush)

    def _flush(self) -> None:
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        events, self.outbox = self.outbox, []
        merged: dict[str, scheduler_pb2.TokenEvent] = defaultdict(scheduler_pb2.TokenEvent)
        for ev in events:
            out = merged[ev.request_id]
            if ev.admitted:
                out.admitted, out.queue_time_s = True, ev.queue_time
            if ev.token_id is not None:
                out.token_ids.append(ev.token_id)
            if ev.finish is not None:
                out.finish_reason = FINISH_TO_PROTO[ev.finish]
                out.error, out.preemptions = ev.error, ev.preemptions
        for rid, out in merged.items():
            queue = self.streams.get(rid)
            if queue is not None:
                queue.put_nowait(out)
