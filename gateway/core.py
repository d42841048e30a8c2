"""The gateway's generation path, whatever the protocol: the request checked and tokenized at
the gateway's door (gateway/intake.py), then trusted: the queue limits, the submission to the
scheduler (resubmitting to a restarted one), text deltas streamed back.

`GatewayCore.generate` yields `Delta`s and one `Finish`, or raises `GenerationError` with a gRPC
status code (the vocabulary of the scheduler's answers): the gRPC service passes it on as is, the
HTTP API maps it to an HTTP status. Leaving the iteration (the client went away, its deadline
passed) cancels the scheduler's call, which frees the request's KV at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from gateway.api_keys import KeyEntry
from gateway.auth import cache_salt
from gateway.cells import Cells
from gateway.detokenizer import IncrementalDetokenizer
from gateway.generation_errors import ContextLengthExceeded, GenerationError, NoCell, QueueFull
from gateway.intake import GenerateInput, Intake
from gateway.key_table import KeyTable
from gateway.queue_limits import QueueClaim, QueueLimits, QueueRefusal
from gateway.request_tenancy import tenancy_for
from gateway.routing import Route
from gateway.scheduler_session import SchedulerSession, SessionCall, rpc_error
from gateway.settings import GatewaySettings
from gateway.stops import StopMatcher
from gateway.tokenizer import Tokenizer
from gateway.usage import Tally
from gateway.validation import InvalidRequest, ValidatedParams
from llmcommon.protocol import ACCEPTED_KEY
from llmcommon.sampling_wire import to_wire
from llmcommon.tenancy import Tenancy
from llmcommon.tenancy_wire import tenancy_to_wire
from llmcommon.v1 import common_pb2, scheduler_pb2

__all__ = [  # the door's request and the errors too, as the generation path's callers know them
    "ContextLengthExceeded",
    "Delta",
    "Finish",
    "GatewayCore",
    "GenerateInput",
    "GenerationError",
    "QueueFull",
]

log = logging.getLogger("gateway")
RESUBMIT_PERIOD_S = 0.25  # a resubmission waiting for the scheduler tries again this often


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)  # when asked
    prompt_tokens: int = 0  # the request's, for usage figures as the tokens come


@dataclass(frozen=True, slots=True)
class Finish:
    request_id: str  # the scheduler's key
    reason: int  # common_pb2.FinishReason
    usage: common_pb2.Usage
    error: str = ""
    cell: str = ""  # with --cells: the cell that finished it
    route: str = ""  # ... and why it went there (match, load, round-robin, session, fallback)


@dataclass(slots=True)
class _Flight:
    """One request while a scheduler holds it, across resubmissions."""

    submit: scheduler_pb2.SubmitRequest  # resume_token_ids: what a resubmission resumes after
    call: grpc.aio.UnaryStreamCall | SessionCall  # the scheduler's call for it now
    tally: Tally
    queued: bool = True  # counted by the queue limits until the scheduler admits it
    finish: int = common_pb2.FINISH_REASON_UNSPECIFIED
    error: str = ""
    streamed: list[int] = field(default_factory=list)  # every token received
    route: Route | None = None  # with --cells: the cell it is on now, and why
    keys: list[int] = field(default_factory=list)  # with --cells: its prompt's block keys
    session: str = ""  # with --cells: what the session policy sticks by

    @property
    def rid(self) -> str:
        return self.submit.request_id


class GatewayCore:
    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer: Tokenizer,
        scheduler,  # SchedulerStub
        max_context: int,
        model: str = "",
        model_name: str = "",
        keys: KeyTable | None = None,
        cells: Cells | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_context = max_context
        self.model = model  # the name the workers serve, from the scheduler's status
        self.model_name = model_name or model  # the model this gateway's tokenizer is for
        self.refusal: str | None = None  # set while the workers serve another model
        self.scheduler_hung: str | None = None  # set while the scheduler answers nothing
        self.held: set = set()  # the scheduler calls of the requests in flight
        self.cell_of: dict = {}  # with --cells: each held call's cell
        session = settings.scheduler_streams == "session"
        self.session = SchedulerSession(scheduler) if session else None
        self.cells = cells  # several schedulers (--cells): each request routed to one
        self.on_route: Callable[[Route], None] | None = None  # metrics hook
        self.keys = keys or KeyTable(settings)  # who may send requests, and as which tenant
        self.queue = QueueLimits(settings.max_queued_requests, settings.max_queued_tokens)
        self.pool = ThreadPoolExecutor(settings.tokenize_threads, thread_name_prefix="tokenize")
        self.intake = Intake(settings, tokenizer, max_context, self.pool)  # the door: what is sent
        self.observer = None  # metrics hook, set by the metrics module
        self.on_tokens = None  # metrics hook: (tally, count, now) before the tally counts them
        self.on_queue_full: Callable[[QueueRefusal], None] | None = None  # metrics hook

    async def prepare(self, job: GenerateInput) -> tuple[ValidatedParams, list[int]]:
        """The request checked, its defaults resolved and its prompt tokenized (gateway/intake.py);
        raises ValueError."""
        return await self.intake.prepare(job)

    def claim(self, n: int) -> QueueClaim:
        """The queue places of a request's `n` choices, to share among their `generate` calls
        and close when the request ends."""
        return QueueClaim(self.queue, n)

    async def generate(
        self,
        job: GenerateInput,
        time_remaining: Callable[[], float | None],
        rid: str = "",
        key: KeyEntry | None = None,
        claim: QueueClaim | None = None,
    ) -> AsyncIterator[Delta | Finish]:
        """Deltas of text (with their token ids), then one Finish; or GenerationError.
        `time_remaining`: seconds left before the client's deadline (None: no deadline).
        `rid`: the scheduler's key (default: a new one); never a client's id, which may collide.
        `key`: the entry of the API key that sent it (default: the keys' open entry).
        `claim`: the queue places of the request's `n` choices, shared by them (`claim(n)`; its
        owner closes it when the request ends); default: this request's own."""
        if self.refusal is not None:
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, self.refusal)
        if self.scheduler_hung is not None:
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, self.scheduler_hung)
        entry = key or self.keys().open_entry
        tally = Tally(tenancy=self._tenancy(entry, job))
        rid = rid or uuid.uuid4().hex
        # refusals are raised where they are made, never held in a local: an exception held
        # by the frame its traceback holds is a cycle, which kept a refused request (a 0.8 MB
        # chat parses into 100k messages) until a full garbage collection
        try:
            params, prompt_ids = await self.prepare(job)
        except ValueError as err:  # InvalidRequest, a template's refusal, invalid Unicode
            invalid, param = str(err) or type(err).__name__, getattr(err, "param", None)
        else:
            invalid = None
        if invalid is not None:
            raise GenerationError(grpc.StatusCode.INVALID_ARGUMENT, invalid, param)
        sampling = self.intake.fitted(prompt_ids, job, params.sampling)  # trusted from here on
        tenant, count = entry.tenant, len(prompt_ids)
        tally.prompt_tokens = count
        submit = scheduler_pb2.SubmitRequest(
            request_id=rid,
            prompt_token_ids=prompt_ids,
            sampling=to_wire(sampling),
            cache_salt=cache_salt(entry.cache_tenant, job.cache_salt),
            tenancy=tenancy_to_wire(tally.tenancy),
        )
        claim = claim or QueueClaim(self.queue)
        full = claim.take(count, tenant, entry.max_queued, entry.max_queued_tokens)
        if full is not None and full.never:
            raise GenerationError(grpc.StatusCode.RESOURCE_EXHAUSTED, full.message, full.param)
        if full is not None:
            if self.on_queue_full is not None and claim.first_refusal():
                self.on_queue_full(full)
            raise QueueFull(full.message)
        flight = _Flight(submit, None, tally)  # type: ignore[arg-type]
        if self.cells is not None:
            flight.keys = self.cells.keys_of(prompt_ids, submit.cache_salt)
            flight.session = job.session or tenant
        try:
            flight.call = self._submit(submit, time_remaining, flight)
        except GenerationError:
            self.queue.leave(count, tenant)
            raise
        detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=job.skip_special_tokens, prompt_ids=prompt_ids
        )
        stops = StopMatcher(list(sampling.stop), include_stop=job.include_stop)
        try:
            deltas = self._resubmitting(flight, detok, stops, time_remaining)
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    yield delta
            if flight.finish == common_pb2.FINISH_REASON_ERROR:
                error = flight.error or "generation failed"
                raise GenerationError(grpc.StatusCode.UNAVAILABLE, error)
            if not stops.stopped:
                tail, _ = stops.push(detok.flush())
                tail += stops.flush()
                if tail:
                    yield Delta(tail, [], prompt_tokens=tally.prompt_tokens)
        except asyncio.CancelledError:
            if self._given_up():
                raise GenerationError(grpc.StatusCode.UNAVAILABLE, self.scheduler_hung) from None
            flight.finish = common_pb2.FINISH_REASON_CANCELLED  # the client left, or its deadline
            raise
        except GeneratorExit:  # the client left
            flight.finish = common_pb2.FINISH_REASON_CANCELLED
            raise
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:  # the client's own deadline
                flight.finish = common_pb2.FINISH_REASON_CANCELLED
            details = err.details() or "the scheduler failed"
            if err.code() is grpc.StatusCode.UNAVAILABLE:  # e.g. "Socket closed": say where
                details = f"the scheduler is unavailable or has no worker ({details}); retry"
            raise GenerationError(err.code(), details) from None
        finally:
            if flight.queued:
                self.queue.leave(count, tenant)
            flight.call.cancel()
            self._release(flight.call)
            if flight.route is not None and self.cells is not None:
                self.cells.router.done(flight.route)
            if self.observer is not None:
                self.observer(flight.finish, tally)
        cell, why = (flight.route.cell, flight.route.reason.value) if flight.route else ("", "")
        yield Finish(rid, flight.finish, tally.usage(), flight.error, cell, why)

    def _tenancy(self, entry: KeyEntry, job: GenerateInput) -> Tenancy:
        """The request's tenancy from its key and what it asks for, or INVALID_ARGUMENT naming
        priority or slo_class (nothing queued)."""
        try:
            return tenancy_for(entry, job.priority, job.slo_class, self.keys.classes)
        except InvalidRequest as err:
            raise GenerationError(grpc.StatusCode.INVALID_ARGUMENT, str(err), err.param) from None

    async def _resubmitting(
        self,
        flight: _Flight,
        detok: IncrementalDetokenizer,
        stops: StopMatcher,
        time_remaining: Callable[[], float | None],
    ) -> AsyncIterator[Delta]:
        """The request's deltas. A scheduler lost while it held the request (or while its
        resubmission waits) gets it again, resuming after the tokens streamed, until it is
        back within --resubmit-timeout; a request whose tokens say it has ended is not sent."""
        resume_by: float | None = None  # resubmitting: the scheduler must be back by then
        while True:
            try:
                async with contextlib.aclosing(self._stream(flight, detok, stops)) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            except grpc.aio.AioRpcError as err:
                if await self._other_cell(flight, err, time_remaining):
                    # resubmitting now: if that cell fails it too before accepting it, it is
                    # still the request's scheduler that was lost, not a refusal
                    resume_by = resume_by or time.monotonic() + self.settings.resubmit_timeout
                    continue
                if not await _scheduler_lost(flight.call, err, resume_by is not None):
                    raise
                wire = flight.submit.sampling
                flight.finish = _known_end(flight.streamed, wire.max_tokens, wire.stop_token_ids)
                if flight.finish:  # only its end was lost: resubmitted, it would run on
                    return
                now = time.monotonic()
                if resume_by is None or await _accepted(flight.call):
                    resume_by = now + self.settings.resubmit_timeout
                    why = err.code().name
                    log.warning("request %s: scheduler lost (%s); resubmitting", flight.rid, why)
                elif now > resume_by:
                    raise
                else:
                    await asyncio.sleep(RESUBMIT_PERIOD_S)
            await self._resubmit(flight, time_remaining, resume_by)

    async def _resubmit(
        self,
        flight: _Flight,
        time_remaining: Callable[[], float | None],
        resume_by: float,
        exclude: frozenset[str] = frozenset(),
    ) -> None:
        """Send the request again, resuming after the tokens streamed. With --cells and no live
        cell (but `exclude` at first), it waits for one to answer until `resume_by`, as the
        single-scheduler path waits for its scheduler; then UNAVAILABLE."""
        flight.tally.resubmits += 1
        del flight.submit.resume_token_ids[:]
        flight.submit.resume_token_ids.extend(flight.streamed)
        self._release(flight.call)
        if flight.route is not None and self.cells is not None:
            self.cells.router.done(flight.route)
            flight.route = None
        while True:
            try:
                flight.call = self._submit(flight.submit, time_remaining, flight, exclude)
                return
            except NoCell:
                if time.monotonic() > resume_by:
                    raise
            await asyncio.sleep(RESUBMIT_PERIOD_S)
            exclude = frozenset()  # the lost cell may be the one that comes back

    async def _other_cell(self, flight: _Flight, err: grpc.aio.AioRpcError, time_remaining) -> bool:
        """With --cells: the request's cell failed it as a lost scheduler does (UNAVAILABLE,
        or its stream broke): the cell is routed around, and the request, unless its tokens say
        it has ended, goes to another live cell at once, resuming after the tokens streamed (the
        dead cell's call cancelled first: it is never on two cells). False: no other cell."""
        if self.cells is None or flight.route is None:
            return False
        if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return False
        if err.code() is grpc.StatusCode.CANCELLED and not await _accepted(flight.call):
            return False  # (the client's own cancel, or a refusal)
        lost = flight.route
        wire = flight.submit.sampling
        ended = _known_end(flight.streamed, wire.max_tokens, wire.stop_token_ids)
        others = self.cells.router.alive_mask & ~(1 << self.cells.router.slots[lost.cell])
        if ended or not others:
            return False
        flight.call.cancel()
        self.cells.lost(lost)
        flight.route = None
        log.warning("request %s: cell %s lost (%s); resubmitting to another", flight.rid,
                    lost.cell, err.code().name)  # fmt: skip
        resume_by = time.monotonic() + self.settings.resubmit_timeout
        await self._resubmit(flight, time_remaining, resume_by, frozenset({lost.cell}))
        return True

    async def _stream(
        self, flight: _Flight, detok: IncrementalDetokenizer, stops: StopMatcher
    ) -> AsyncIterator[Delta]:
        """The deltas of one scheduler call (on the session, or a Submit call), until the
        request finishes or a stop string ends it."""
        tally = flight.tally
        async for event in flight.call:
            if event.admitted and flight.queued:
                self.queue.leave(tally.prompt_tokens, tally.tenancy.tenant)
                flight.queued = False
                tally.queue_time = event.queue_time_s
                tally.cached_tokens = event.cached_tokens
            if event.token_ids:
                now = time.monotonic()
                # a request the scheduler stopped ended at a stop token (EOS or one of its
                # stop_token_ids), which arrives with the finish: counted, not rendered (vLLM)
                silent = event.finish_reason == common_pb2.FINISH_REASON_STOP
                silent = silent and not stops.include_stop
                text, kept, hit = _until_stop(detok, stops, list(event.token_ids), silent)
                ids, lps = list(event.token_ids[:kept]), list(event.logprobs[:kept])
                if self.on_tokens is not None:
                    self.on_tokens(tally, kept, now)
                tally.first_token_at = tally.first_token_at or now
                tally.last_token_at = now
                tally.completion_tokens += kept
                flight.streamed += ids
                yield Delta(text, ids, lps, tally.prompt_tokens)
                if hit:
                    flight.finish = common_pb2.FINISH_REASON_STOP
                    flight.call.cancel()
                    return
            if event.finish_reason:
                flight.finish, flight.error = event.finish_reason, event.error
                tally.preemptions = event.preemptions

    def _submit(
        self,
        submit: scheduler_pb2.SubmitRequest,
        time_remaining,
        flight: _Flight | None = None,
        exclude: frozenset[str] = frozenset(),
    ):
        if self.cells is not None and flight is not None:
            placed = self.cells.place(
                submit, flight.keys, flight.session, time_remaining(), exclude
            )
            if placed is None:
                raise NoCell()
            call, flight.route = placed
            if self.on_route is not None:
                self.on_route(flight.route)
            self.held.add(call)
            self.cell_of[call] = flight.route.cell
            return call
        if self.session is not None:
            call = self.session.submit(submit, time_remaining())
        else:
            call = self.scheduler.Submit(submit, timeout=time_remaining())
        self.held.add(call)
        return call

    def _release(self, call) -> None:
        self.held.discard(call)
        self.cell_of.pop(call, None)

    def abandon_cell(self, cell: str) -> None:
        """With --cells: `cell` is hung (its connection open, no answer): each request it holds
        fails there as on a dead cell's stream, and is resubmitted to another (the hung cell's
        call cancelled first: the cancel reaches it when it runs again)."""
        lost = rpc_error(grpc.StatusCode.UNAVAILABLE, f"cell {cell} answers nothing (hung?)")
        for call, where in list(self.cell_of.items()):
            if where != cell or call not in self.held:
                continue
            if isinstance(call, SessionCall):
                call.abandon(lost)
            else:
                call.cancel()

    def give_up_on_scheduler(self, problem: str) -> None:
        """The scheduler has answered nothing for too long: end every request it holds with
        UNAVAILABLE (`problem`), as if it had died (see gateway/scheduler_watch.py)."""
        self.scheduler_hung = problem
        for call in list(self.held):
            call.cancel()

    def _given_up(self) -> bool:
        """Was this request's call cancelled by give_up_on_scheduler (not its task: the client
        leaving cancels the task)?"""
        task = asyncio.current_task()
        return self.scheduler_hung is not None and task is not None and not task.cancelling()


def _until_stop(
    detok: IncrementalDetokenizer, stops: StopMatcher, ids: list[int], silent_last: bool = False
) -> tuple[str, int, bool]:
    """The text of `ids` that may be emitted, how many of them count, and whether a stop string
    was hit. Several tokens in one event (a decode run's) are pushed one at a time while stop
    strings are watched, so the output ends at the token that completes a stop: the tokens after
    it are neither sent nor counted in usage. `silent_last`: the last token (the stop token that
    ended the request) counts, but its text is not rendered."""
    shown = ids[:-1] if silent_last else ids
    if len(shown) <= 1 or not stops.watching:
        text, hit = stops.push(detok.push(shown)) if shown else ("", False)
        return text, len(shown) if hit else len(ids), hit
    parts = []
    for i, token in enumerate(shown):
        text, hit = stops.push(detok.push([token]))
        parts.append(text)
        if hit:
            return "".join(parts), i + 1, True
    return "".join(parts), len(ids), False


def _known_end(streamed: list[int], max_tokens: int, stop_token_ids: Sequence[int]) -> int:
    """How a request whose finish was lost has ended, if its tokens say so (UNSPECIFIED: it
    may go on): all max_tokens streamed, or the last one is a stop_token_id (EOS is left to
    the scheduler, which knows the model's and whether ignore_eos holds)."""
    if len(streamed) >= max_tokens:
        return common_pb2.FINISH_REASON_LENGTH
    if streamed and streamed[-1] in stop_token_ids:
        return common_pb2.FINISH_REASON_STOP
    return common_pb2.FINISH_REASON_UNSPECIFIED


async def _accepted(call) -> bool:
    """Did the scheduler take this call's request (it says so in its first metadata)?"""
    metadata = await call.initial_metadata()
    return any(key == ACCEPTED_KEY for key, _ in metadata or ())


async def _scheduler_lost(call, err: grpc.aio.AioRpcError, resubmitting: bool) -> bool:
    """The scheduler went away (killed, restarted, stopped past its drain) while it held this
    request, or while a resubmission waits for it to come back: resubmit. A refusal of a new
    request, or an answer from a live scheduler, is the client's."""
    if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return False
    return resubmitting or await _accepted(call)
