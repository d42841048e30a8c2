"""A scheduler that was stopped (SIGSTOP) or blocked does not blame its workers: a step's answer
is late only by the scheduler's own running time (scheduler_svc/run_clock.py), and a late
worker is asked its health before it is failed. Pure: a scripted wall clock, a fake stream."""

from __future__ import annotations

import asyncio

import pytest

from llmcommon.v1 import worker_pb2
from scheduler_svc.config import WorkerSpec
from scheduler_svc.run_clock import STALL_AFTER_S, RunClock
from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.worker_client import WorkerLost
from scheduler_svc.worker_loop import WorkerLoop
from tests.inproc import InProcessClient

SPEC = WorkerSpec("w0", 64, 4, 256)
HANG_FLOOR = 1.0


class Wall:
    """A scripted monotonic clock: time passes only when told to."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_running_clock_follows_the_wall_while_the_loop_runs() -> None:
    wall = Wall()
    clock = RunClock(wall)
    start = clock.now()
    for _ in range(50):
        wall.t += 0.1
        clock.mark()
    assert clock.now() - start == pytest.approx(5.0)
    assert clock.stalls == 0


def test_a_stall_does_not_count_even_before_the_loop_marks_itself_again() -> None:
    wall = Wall()
    clock = RunClock(wall)
    start = clock.now()
    wall.t += 8.0  # SIGSTOP for 8 s: no mark meanwhile
    assert clock.now() - start == pytest.approx(STALL_AFTER_S)  # read before the next mark
    clock.mark()
    assert clock.now() - start == pytest.approx(STALL_AFTER_S)
    assert clock.stalls == 1 and clock.stalled_seconds() == pytest.approx(8.0 - STALL_AFTER_S)


def test_the_running_clock_never_goes_back_during_a_long_gap() -> None:
    wall = Wall()
    clock = RunClock(wall)
    readings = []
    for _ in range(30):
        wall.t += 0.05
        readings.append(clock.now())
    assert readings == sorted(readings)


class ScriptedStream:
    """A worker's step stream on the scripted wall: the answer comes at `answer_at` (None =
    never); the scheduler's loop marks itself running every 0.1 s except within `stopped`."""

    def __init__(self, wall: Wall, clock: RunClock, answer_at, stopped=(0.0, 0.0)) -> None:
        self.wall, self.clock, self.answer_at, self.stopped = wall, clock, answer_at, stopped

    def _advance(self, seconds: float) -> None:
        end = self.wall.t + seconds
        while self.wall.t < end:
            self.wall.t = min(end, self.wall.t + 0.1)
            if not self.stopped[0] <= self.wall.t < self.stopped[1]:
                self.clock.mark()

    async def receive(self, timeout: float):
        if self.answer_at is not None and self.answer_at <= self.wall.t + timeout:
            self._advance(max(0.0, self.answer_at - self.wall.t))
            return worker_pb2.StepResult()
        self._advance(timeout)
        return None


class Health(InProcessClient):
    def __init__(self, answers: bool) -> None:
        super().__init__(SPEC)
        self.answers, self.checks = answers, 0

    async def serving(self, timeout: float = 1.0) -> bool | None:
        self.checks += 1
        return True if self.answers else None


def loop_and_clock(client: Health) -> tuple[WorkerLoop, Wall]:
    service = SchedulerService(SchedulerSettings(hang_floor=HANG_FLOOR), [client])
    wall = Wall()
    service.clock = RunClock(wall)
    return WorkerLoop(service.core, service.settings, service, 0, client), wall


def answer(loop: WorkerLoop, stream: ScriptedStream):
    return asyncio.run(loop.answer(stream, loop.host.clock.now()))


def test_an_answer_read_after_the_scheduler_was_stopped_is_not_late() -> None:
    """SIGSTOP of the scheduler for 8 s with the answer waiting in the socket since 0.2 s: by
    the wall clock it is 8 hang bounds late; by the scheduler's running time it is not."""
    client = Health(answers=True)
    loop, wall = loop_and_clock(client)
    stream = ScriptedStream(wall, loop.host.clock, wall.t + 8.2, (wall.t + 0.1, wall.t + 8.1))
    assert answer(loop, stream) is not None
    assert client.checks == 0  # it was never even suspected


def test_a_worker_whose_health_does_not_answer_either_is_failed_after_one_bound() -> None:
    client = Health(answers=False)
    loop, wall = loop_and_clock(client)
    started = wall.t
    stream = ScriptedStream(wall, loop.host.clock, None)
    with pytest.raises(WorkerLost, match="its health does not answer"):
        answer(loop, stream)
    assert wall.t - started == pytest.approx(HANG_FLOOR)
    assert client.checks == 1


def test_a_silent_step_of_a_worker_whose_health_answers_fails_after_a_second_bound() -> None:
    """A stuck kernel keeps the worker's health answering: it gets one more hang bound, then it
    is failed all the same (bounded: never --execute-timeout)."""
    client = Health(answers=True)
    loop, wall = loop_and_clock(client)
    started = wall.t
    with pytest.raises(WorkerLost, match="its health answers"):
        answer(loop, ScriptedStream(wall, loop.host.clock, None))
    assert wall.t - started == pytest.approx(2 * HANG_FLOOR)
    assert client.checks == 2


def test_an_answer_within_the_second_bound_is_taken() -> None:
    client = Health(answers=True)
    loop, wall = loop_and_clock(client)
    stream = ScriptedStream(wall, loop.host.clock, wall.t + 1.5 * HANG_FLOOR)
    assert answer(loop, stream) is not None
    assert client.checks == 1
