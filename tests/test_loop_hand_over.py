"""The step loop hands a completed step's tokens to their requests before it waits for the next
answer. With overlap, the step planned while a request's prompt ran (its decode, or a decode
run) may take every token the request has left; the loop then had nothing to send after the
prompt's answer, and the first token waited for that step's answer too: one more step on the
TTFT, a whole run's time where the step was a run (a chat whose prompt was cached got its first
token with its last)."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.config import DecodeRuns, WorkerSpec
from scheduler_svc.output import StepTokens
from scheduler_svc.sequence import Sequence
from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.worker_loop import WorkerLoop
from tests.inproc import InProcessClient, InProcessStream

SPEC = WorkerSpec("w0", 64, 4, 256)


class GatedStream(InProcessStream):
    """The simulated worker; every answer after the first is held until `gate` opens.
    `answered`: the tokens of the answers handed to the loop."""

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.gate = asyncio.Event()
        self.held = asyncio.Event()  # the loop waits on a held answer
        self.answered = 0

    async def receive(self, timeout: float):
        result = await self.results.get()
        if self.answered and not self.gate.is_set():
            self.held.set()
            await self.gate.wait()
        self.answered += len(result.tokens)
        return result


async def tokens_while_the_next_answer_is_held(max_tokens: int) -> tuple[int, int]:
    """(tokens answered, tokens handed to the request) while the loop waits on the second
    answer."""
    settings = SchedulerSettings(decode_steps=8, decode_runs=DecodeRuns.FIXED.value)
    client = InProcessClient(SPEC)
    service = SchedulerService(settings, [client])
    core = service.core
    core.add_worker(SPEC)
    dispatched: list[int] = []
    service.dispatch = lambda events: dispatched.extend(  # type: ignore[method-assign]
        t for e in events if isinstance(e, StepTokens) for _, t in e
    )
    loop = WorkerLoop(core, settings, service, 0, client)
    stream = GatedStream(SPEC)
    core.add(Sequence("r", [3, 5, 8, 4, 9], max_tokens))
    task = asyncio.create_task(loop.drive(stream))
    try:
        await asyncio.wait_for(stream.held.wait(), 10)
        for _ in range(20):  # the loop had every chance to hand the tokens over
            await asyncio.sleep(0)
        return stream.answered, len(dispatched)
    finally:
        stream.gate.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("max_tokens", [2, 3, 8, 20])
def test_the_first_token_reaches_its_request_while_the_next_step_runs(max_tokens) -> None:
    answered, dispatched = asyncio.run(tokens_while_the_next_answer_is_held(max_tokens))
    assert answered == 1  # the prompt's step: the first token
    assert dispatched == 1  # with its request, not held for the step after it
