"""The step loop of one worker: plan its next step, send it, complete the one before.

With overlap, step N+1 is planned and sent while N runs, so the worker finds its next batch
waiting; without, each step is planned once the one before has completed (the seed's order).

The loop is handed the core, the scheduler's settings and a `LoopHost` (the service): what it
reports to and reads from whoever runs it. It never imports the service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from scheduler_svc.core import Scheduler
from scheduler_svc.messages import step_message
from scheduler_svc.output import StepLogprobs
from scheduler_svc.run_clock import RunClock
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.step import Step
from scheduler_svc.step_cost import BatchShape, step_shape
from scheduler_svc.step_model import StepModels
from scheduler_svc.step_times import StepTimes
from scheduler_svc.worker_client import StepStream, WorkerClient, WorkerLost

log = logging.getLogger("scheduler")
IDLE_POLL_S = 0.05  # an idle loop looks at the queue at least this often


@dataclass(frozen=True, slots=True)
class InFlight:
    """A step sent to the worker, not completed yet."""

    step: Step
    started: float  # perf_counter when its planning began
    running: float  # the host clock when it was sent (how late its answer is)
    shape: BatchShape  # its work as planned, for the worker's step-time model


class LoopHost(Protocol):
    """What a step loop needs from whoever runs it."""

    clock: RunClock  # the scheduler's own running time: how late a worker's answer is
    times: StepTimes  # where the steps' time went, summed over the loops
    on_step: Callable[[int, Step, float], None] | None  # (index, step, forward seconds)
    step_models: StepModels  # each worker's step-time model: learns from every step it ran

    def after_plan(self, step: Step) -> None:
        """A step was planned: check it, wake the loops it names, pass on its outputs."""

    def check(self) -> None:
        """A step was completed: check the core's invariants (where asked to)."""

    def dispatch(self, events: list) -> None:
        """The core's outputs, to the request streams."""

    def worker_lost(self, index: int, err: BaseException) -> None:
        """The loop ended: its worker failed or left."""

    def died(self, task: asyncio.Task) -> None:
        """The loop's task is done: a crash stops the scheduler."""


class WorkerLoop:
    def __init__(
        self,
        core: Scheduler,
        settings: SchedulerSettings,
        host: LoopHost,
        index: int,
        client: WorkerClient,
    ) -> None:
        self.core = core
        self.settings = settings
        self.host = host
        self.index = index
        self.client = client
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.depth = 2 if settings.overlap else 1  # steps in flight at most
        self.last_result = 0.0
        self.events: list = []  # the last completed step's, handed over after the next send
        self.slowest = 0.0  # the longest a step of this worker has taken (wall seconds)
        self.failure: str | None = None  # why the supervisor failed this loop from outside

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"worker-loop-{self.index}")
        self.task.add_done_callback(self.host.died)

    def hang_bound(self) -> float:
        """How long a step's answer may take before the worker counts as hung:
        max(--hang-floor, --hang-factor x its slowest step so far), at most --execute-timeout."""
        s = self.settings
        return min(s.execute_timeout, max(s.hang_floor, s.hang_factor * self.slowest))

    def fail(self, reason: str) -> None:
        """The worker is alive to TCP but not answering (hung): give up on it now."""
        if self.task is not None and not self.task.done() and self.failure is None:
            self.failure = reason
            self.task.cancel()

    async def run(self) -> None:
        """Drive the worker until it fails or leaves; the host decides what comes next."""
        stream = self.client.open()
        try:
            await self.drive(stream)
        except WorkerLost as err:
            lost = err
        except asyncio.CancelledError:
            if self.failure is None:
                raise  # the scheduler is stopping
            asyncio.current_task().uncancel()
            lost = WorkerLost(self.failure)
        finally:
            stream.cancel()
        self.hand_over()  # tokens already recorded reach their streams before any requeue
        self.host.worker_lost(self.index, lost)

    def hand_over(self) -> None:
        events, self.events = self.events, []
        self.host.dispatch(events)

    async def drive(self, stream: StepStream) -> None:
        """Launch the next step while fewer than `depth` are in flight, then complete the
        oldest. With overlap (depth 2) step N+1 is planned and sent before N's answer is
        awaited, as mini-sglang's overlap_loop; without (depth 1) each step completes before
        the next is planned. A step that only releases KV is sent, never overlapped. A
        completed step's outputs go out once the next step is sent, or at once when there is
        none to send: they never wait for a step in flight (a request's first token held
        behind the decode run planned for it, a whole run's time on its TTFT)."""
        inflight: deque[InFlight] = deque()
        ws = self.core.workers[self.index]
        while ws.healthy:
            if len(inflight) < self.depth:
                started = time.perf_counter()
                step = self.plan()
                if step.has_work or step.released:
                    await self.launch(stream, step, started, inflight)
                    if step.has_work and len(inflight) < self.depth:
                        continue  # overlap: plan the next step now, then wait for this one
                elif not inflight:
                    await self.idle(stream)
                    continue
            if self.events:  # nothing was sent: what completed goes out before the next wait
                self.hand_over()
            await self.complete_oldest(stream, inflight)

    def plan(self) -> Step:
        self.wake.clear()  # before planning: a Submit from now on wakes it again
        started = time.perf_counter()
        step = self.core.schedule(self.index)
        self.host.times.core_seconds += time.perf_counter() - started
        self.host.after_plan(step)
        return step

    async def launch(
        self, stream: StepStream, step: Step, started: float, inflight: deque[InFlight]
    ) -> None:
        """Send a planned step; the last completed step's outputs go out once it is sent."""
        msg = step_message(self.core.steps, step)
        self.client.step_bytes += msg.ByteSize()
        await stream.send(msg)
        inflight.append(InFlight(step, started, self.host.clock.now(), step_shape(step)))
        self.hand_over()

    async def idle(self, stream: StepStream) -> None:
        """Nothing to run: wait for a wake (a Submit, a finish elsewhere) or IDLE_POLL_S."""
        self.hand_over()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(IDLE_POLL_S):  # never swallows a cancel
                await self.wake.wait()
        stream.check()

    async def complete_oldest(self, stream: StepStream, inflight: deque[InFlight]) -> None:
        result = await self.answer(stream, inflight[0].running)
        done = inflight.popleft()
        self.events += self.complete(done.step, result, done.started)
        if not (result.error or result.failed):  # the forward time of one execution as planned
            runs = done.step.repeat
            self.host.step_models.observe(self.index, done.shape, result.forward_seconds / runs)

    async def answer(self, stream: StepStream, sent: float):
        """The oldest step's result. The worker is hung (WorkerLost) only when the answer is
        late by the scheduler's own running time (`sent` on host.clock): a scheduler that
        was stopped or blocked does not blame its workers. A late worker is then asked its
        health: one that does not answer is failed at once; one that answers gets one more
        hang bound (the answer may be on its way), then fails all the same (a stuck kernel
        keeps health answering)."""
        clock = self.host.clock
        due, chances = sent + self.hang_bound(), 1
        while True:
            result = await stream.receive(max(0.0, due - clock.now()))
            if result is not None:
                return result
            if clock.now() < due:
                continue  # the scheduler itself did not run all that time: wait on
            late = clock.now() - sent
            alive = await self.client.serving() is not None
            result = await stream.receive(0.0)  # it may have come during the health check
            if result is not None:
                return result
            if alive and chances:
                chances -= 1
                due = clock.now() + self.hang_bound()
                log.warning(
                    "worker %s: no answer to a step in %.1f s, but its health answers: "
                    "waiting %.1f s more",
                    self.core.workers[self.index].spec.name, late, self.hang_bound(),
                )  # fmt: skip
                continue
            health = "answers" if alive else "does not answer"
            raise WorkerLost(f"no answer to a step in {late:.1f} s; its health {health}")

    def complete(self, step: Step, result, sent: float) -> list:
        host, client = self.host, self.client
        started = time.perf_counter()
        name = self.core.workers[self.index].spec.name
        events: list = []  # what the core returns: finishes, then the step's tokens and finishes
        if result.failed:
            for handle, why in result.failed.items():
                log.warning("worker %s could not run request handle %d: %s", name, handle, why)
            events += self.core.fail_items(step, dict(result.failed), name)
        tokens, emitted = list(result.tokens), list(result.emitted)
        if not result.error and len(emitted) != len(step.drafts):
            result.error = (
                f"{len(emitted)} draft results for {len(step.drafts)} drafts (a worker that "
                f"does not verify drafts? speculative decoding needs one that does)"
            )
        elif not result.error:  # a worker's answer is checked, never trusted to crash us
            vocab = client.info.vocab_size if client.info is not None else 0
            result.error = answer_problem(step, tokens, emitted, vocab)
        # whose logprobs the tokens carry: read before `complete` moves or finishes requests
        owners = (
            StepLogprobs.owners(step, tokens, emitted)
            if result.logprobs and not result.error
            else []
        )
        if owners and len(owners) != len(result.logprobs):
            result.error = f"{len(result.logprobs)} logprobs for {len(owners)} sampled tokens"
            owners = []
        if result.error:
            log.error(
                "worker %s failed a step of %d requests: %s", name, step.num_requests, result.error
            )
            events += self.core.fail_step(
                step, f"the model failed on this request's batch on {name} (see its log)"
            )
        else:
            events += self.core.complete(step, tokens, emitted).parts()
        now = time.perf_counter()
        host.check()
        client.last_forward = result.forward_seconds
        client.forward_seconds += result.forward_seconds
        client.idle_seconds += result.idle_seconds
        self.slowest = max(self.slowest, now - sent)
        if step.has_work:
            slot = now - max(sent, self.last_result)  # this step's share of the wall time
            host.times.add(slot, result.forward_seconds, now - started, step.repeat)
            if not result.error:  # the loop's time outside the forward (--decode-runs auto)
                self.core.workers[self.index].overhead.observe(slot, result.forward_seconds)
            if host.on_step is not None:  # once per execution
                for _ in range(step.repeat):
                    host.on_step(self.index, step, result.forward_seconds / step.repeat)
        self.last_result = now
        if owners:
            pairs = zip(owners, result.logprobs, strict=True)
            events.append(StepLogprobs([(rid, lp) for rid, lp in pairs if rid is not None]))
        return events


def answer_problem(step, tokens: list[int], emitted: list[int], vocab: int = 0) -> str:
    """What is wrong with a worker's answer to a step ("" if nothing): a token for every
    sample, each within the worker's vocabulary (`vocab`, 0 = not known); with drafts, each
    draft emits 1 to len(draft) + 1 tokens, and the tokens are the plain ones plus those. A
    malformed answer fails its step's requests like a step the model failed: the scheduler
    and the other workers' requests carry on (it had stopped the scheduler, every request of
    every worker lost; a token outside the vocabulary had gone to the client as nothing)."""
    if vocab and tokens and max(tokens) >= vocab:
        return f"token id {max(tokens)} is outside the worker's vocabulary of {vocab} tokens"
    if not step.drafts:
        if len(tokens) != step.num_sampled:
            return f"{len(tokens)} tokens for {step.num_sampled} samples"
        return ""
    for n, draft in zip(emitted, step.drafts, strict=True):
        if not 1 <= n <= len(draft.token_ids) + 1:
            return f"a draft of {len(draft.token_ids)} tokens emitted {n}"
    plain = step.num_sampled - len(step.drafts)
    if len(tokens) != plain + sum(emitted):
        return f"{len(tokens)} tokens for {plain} plain samples and drafts that emitted {emitted}"
    return ""
