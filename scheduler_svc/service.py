"""The scheduler service: gRPC (Register, Submit, Session, Cancel, Status) in front of the
pure core, and the wiring: the worker set (scheduler_svc/supervision.py), one step loop per worker
(scheduler_svc/worker_loop.py, whose host this service is) and the relay of outputs to the
request streams."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Iterable
from dataclasses import replace

import grpc

from llmcommon.protocol import ACCEPTED_KEY
from llmcommon.sampling import SamplingParams
from llmcommon.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.admin import AdminService
from scheduler_svc.core import Scheduler
from scheduler_svc.invariants import ENV_VAR, check_invariants, check_step
from scheduler_svc.kv_rows import add_row
from scheduler_svc.output import Refused
from scheduler_svc.reasons import RefusalReason
from scheduler_svc.relay import EventRelay, next_message
from scheduler_svc.run_clock import RunClock
from scheduler_svc.sequence import Sequence
from scheduler_svc.session import Rejected, Session
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.step import Step
from scheduler_svc.step_model import StepModels, prior_of
from scheduler_svc.step_times import StepTimes
from scheduler_svc.submit_checks import MAX_ID_CHARS, InvalidSubmission, submission_of
from scheduler_svc.supervision import Supervisor, TokenMismatch
from scheduler_svc.worker_client import BadWorker, WorkerClient
from scheduler_svc.worker_loop import WorkerLoop

log = logging.getLogger("scheduler")

REFUSED_CODE = {  # one for every RefusalReason (a test checks)
    RefusalReason.CONTEXT: grpc.StatusCode.INVALID_ARGUMENT,
    RefusalReason.KV_CAPACITY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RefusalReason.TOKEN_BUDGET: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RefusalReason.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    RefusalReason.NO_WORKER: grpc.StatusCode.UNAVAILABLE,
}


def work_sampling(params: SamplingParams, stop_ids: Iterable[int]) -> SamplingParams:
    """The worker's sampling settings of a request: the request's, as checked at the door,
    without the stop strings (the gateway's), and with every id that ends it as its
    stop_token_ids (the worker masks them under min_tokens)."""
    return replace(params, stop=(), stop_token_ids=tuple(sorted(stop_ids)))


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        settings: SchedulerSettings,
        clients: list[WorkerClient],
        token: str = "",
        absent: list[WorkerClient] | None = None,
        admin_key: str = "",
    ) -> None:
        self.settings = settings
        self.instance = uuid.uuid4().hex  # this process, whatever address it is reached at
        self.loops: list[WorkerLoop | None] = []
        self.step_models = StepModels(prior_of(settings.cost_model))  # one per worker
        self.core = Scheduler(settings.core(), predict=self.step_models.predict)
        self.core.return_wait = settings.worker_return_timeout
        self.admin = AdminService(self.core, self.wake_all, admin_key)  # live settings
        self.streams: dict[str, asyncio.Queue[scheduler_pb2.TokenEvent]] = {}
        self.times = StepTimes()
        self.clock = RunClock()  # the scheduler's own running time: how late a worker is
        self.check_every_step = os.environ.get(ENV_VAR, "") not in ("", "0")
        if self.check_every_step:
            log.warning("%s is set: checking the core's invariants after every step", ENV_VAR)
        self.stopping: asyncio.Event | None = None  # set while it drains (the server's)
        self.on_step = None  # metrics hook: (worker index, step, forward seconds) per execution
        self.on_join = None  # metrics hook: (worker name) when a worker joins
        self.relay = EventRelay(self.streams, settings.stream_interval_ms / 1e3)
        self.workers = Supervisor(
            self.core,
            settings,
            self.clock,
            self.loops,
            self.new_loop,
            self.dispatch,
            self.joined,
            token,
            absent,
        )
        for client in clients:
            self.workers.join(client)

    # ---- gRPC handlers -------------------------------------------------------------------

    async def Register(self, request, context):
        address = request.address.strip()
        if not address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "register needs an address")
        if len(address) > MAX_ID_CHARS:  # it is echoed in errors: not 100 kB of it
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the address has {len(address)} characters; at most {MAX_ID_CHARS}",
            )
        known = [i for i, c in enumerate(self.workers.clients) if c.target == address]
        if known:  # a departed worker is back; a failed one is the watcher's (try_restore)
            gone = self.core.workers[known[0]].gone
            if gone:
                await self.workers.try_restore(known[0])
            return scheduler_pb2.RegisterReply(joined=gone and not self.core.workers[known[0]].gone)
        try:
            added = await self.workers.add_address(address)
        except BadWorker as bad:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, bad.details())
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

    async def Submit(self, request, context):
        try:
            rid, queued = self.accept(request)
        except Rejected as rejected:
            await context.abort(rejected.code, rejected.details)
        if not queued:  # it had ended; only the news was lost
            yield scheduler_pb2.TokenEvent(finish_reason=common_pb2.FINISH_REASON_STOP)
            return
        queue: asyncio.Queue[scheduler_pb2.TokenEvent] = asyncio.Queue()
        self.streams[rid] = queue
        finished = False
        try:  # from here a client that leaves drops its request (it had run on if it left
            # while the acceptance was being sent: 30 of 300 quick cancels, nobody listening)
            await context.send_initial_metadata(((ACCEPTED_KEY, "1"),))
            while not finished:
                event = await next_message(queue)  # what queued up, in one message
                finished = event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                yield event
        finally:
            self.streams.pop(rid, None)
            if not finished:
                self.drop(rid)  # the client went away

    async def Session(self, request_iterator, context):
        session = Session(self)
        tasks = [asyncio.create_task(session.read(request_iterator))]
        if self.stopping is not None:
            tasks.append(asyncio.create_task(session.wake_at_stop(self.stopping)))
        try:
            while (message := await session.next_message()) is not None:
                yield message
            if session.unreadable:  # what had queued went down; its requests are cancelled
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, session.unreadable)
        finally:
            for task in tasks:
                task.cancel()
            session.close()  # requests still on it are cancelled: their KV freed next step

    def accept(self, request: scheduler_pb2.SubmitRequest) -> tuple[str, bool]:
        """Checks a submission and queues it: (its id, queued). Not queued: a resubmission whose
        tokens end in a stop id had already ended, only its finish was lost. Raises Rejected."""
        if self.stopping is not None and self.stopping.is_set():  # as a new call is refused
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "the scheduler is stopping")
        try:
            sub = submission_of(request, self.vocab_size())  # converted and checked once
        except InvalidSubmission as err:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        rid, params, eos_ids = sub.request_id, sub.sampling, self.workers.eos_ids
        stop_ids = (frozenset() if params.ignore_eos else eos_ids) | set(params.stop_token_ids)
        seq = Sequence(
            request_id=rid,
            prompt_ids=sub.prompt_ids,
            output_ids=sub.resume_ids,
            max_tokens=sub.max_tokens,
            ignore_eos=params.ignore_eos,
            sampling=work_sampling(params, stop_ids),
            cache_salt=sub.cache_salt,
            tenancy=sub.tenancy,
        )
        seq.eos_ids, seq.stop_ids = eos_ids, stop_ids
        if sub.resume_ids and sub.resume_ids[-1] in stop_ids:
            return rid, False
        try:
            self.core.add(seq)
        except Refused as refused:
            raise Rejected(REFUSED_CODE[refused.reason], str(refused)) from None
        self.wake_all()  # the caller registers its stream before anything awaits
        return rid, True

    def vocab_size(self) -> int:
        return self.workers.vocab_size()

    async def Cancel(self, request, context):
        finishes = self.core.abort(request.request_id)
        self.dispatch(finishes)
        self.wake_all()
        return scheduler_pb2.CancelReply(found=bool(finishes))

    async def Status(self, request, context):
        snap = self.core.snapshot()
        cfg = self.core.config
        clients = self.workers.clients
        model = clients[0].info.model if clients and clients[0].info else ""
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
            model=model,
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
            step_time_budget_ms=cfg.step_time_budget_ms,
            step_time_window=cfg.step_time_window,
            decode_steps=cfg.decode_steps,
            run_steps=self.core.run_steps,
            decode_runs=cfg.decode_runs.value,
            loop_overhead_ms=1e3 * self.core.loop_overhead_s(),
            arrivals_per_s=self.core.arrivals.per_second(self.core.clock()),
            speculative=cfg.speculative.value,
            num_speculative_tokens=cfg.num_speculative_tokens,
            speculative_length=cfg.speculative_length.value,
            spec_drafts=self.core.spec_drafts,
            spec_draft_tokens=self.core.spec_draft_tokens,
            spec_accepted_tokens=self.core.spec_accepted_tokens,
        )
        reply.stalls.update(snap.stalls)
        reply.refused.update(snap.refused)
        for name, r in self.core.potential.replayed.items():
            reply.spec_potential.add(
                proposer=name, requests=r.requests, tokens=r.tokens, steps=r.steps,
                draft_tokens=r.draft_tokens, accepted_tokens=r.accepted_tokens,
                step_seconds=r.step_seconds, plain_seconds=r.plain_seconds,
            )  # fmt: skip
        reply.spec_potential_skipped = self.core.potential.skipped
        reply.instance = self.instance
        # the snapshot's rows are the workers not gone, in order (two may share a name)
        listed = [c for c, ws in zip(clients, self.core.workers, strict=True) if not ws.gone]
        for kv, client in zip(snap.workers, listed, strict=True):
            out = add_row(reply.workers, kv)  # every figure, stalls too
            if client.info is not None:
                out.address = client.target
                out.forward_seconds = client.forward_seconds
                out.idle_seconds = client.idle_seconds
                out.step_bytes = client.step_bytes
                out.kernels = client.info.kernels  # the worker's pick for its host
            self.step_model_status(out)
        if request.explain:  # the head's explanation, with the admin key only
            await self.admin.explain_into(reply, context)
        return reply

    def step_model_status(self, out: scheduler_pb2.WorkerKv) -> None:
        """A worker's step-time model in its Status entry: recent error, last step."""
        index = next(ws.index for ws in self.core.workers if ws.spec.name == out.name)
        model = self.step_models.models.get(index)
        error = model.error() if model is not None else None
        if model is None or error is None:
            return
        out.step_time_error_p50, out.step_time_error_p90 = error.p50, error.p90
        out.step_time_error_steps = error.steps
        out.last_predicted_seconds, out.last_forward_seconds = model.last

    # ---- wiring: the worker set, the step loops (this service is their LoopHost) ----------

    def start(self) -> None:
        self.clock_task = asyncio.create_task(self.clock.tick(), name="run-clock")
        self.clock_task.add_done_callback(self.died)
        self.workers.start()
        self.watch_task = asyncio.create_task(self.workers.watch_workers())
        self.watch_task.add_done_callback(self.died)
        if self.settings.dns_names:
            self.discover_task = asyncio.create_task(self.workers.discover())
            self.discover_task.add_done_callback(self.died)

    def new_loop(self, index: int, client: WorkerClient) -> WorkerLoop:
        """A step loop for worker `index` (the supervisor starts it)."""
        return WorkerLoop(self.core, self.settings, self, index, client)

    def joined(self, name: str) -> None:
        """A worker joined the stack (the supervisor tells)."""
        if self.on_join is not None:
            self.on_join(name)

    def worker_lost(self, index: int, err: BaseException) -> None:
        """A step loop ended: the supervisor decides whether the worker left or failed."""
        self.workers.worker_lost(index, err)

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
        if step.admissions or step.failed:  # and requests no worker can hold
            self.dispatch(step.admissions + step.failed)

    def wake_all(self) -> None:
        self.workers.wake_all()

    def drop(self, rid: str) -> None:
        """A request nobody listens to any more (its call or session went away, or it was
        cancelled there): aborted without news, its KV freed at the next step."""
        if self.core.abort(rid):
            self.wake_all()

    # ---- events to the request streams ---------------------------------------------------

    def dispatch(self, events: list) -> None:
        if events:
            self.relay.dispatch(events)
