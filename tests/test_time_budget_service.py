"""The step-time budget through the scheduler service: its real step loop drives the sim worker's
step session in-process, and each step's forward time is virtual, from a cost model (what the
sim worker would sleep), so nothing depends on the host's speed. The worker's online model
learns it; halfway the worker gets twice as slow: it then takes fewer prompt tokens per step,
and its steps stay near the budget."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from llmcommon.v1 import scheduler_pb2
from llmserve.client import status_dict
from llmserve.status_text import format_status
from scheduler_svc.config import WorkerSpec
from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.step import Step
from scheduler_svc.step_cost import BatchShape, CostModel
from tests.inproc import InProcessClient, InProcessStream
from tests.sim import seq
from worker_svc.session import Session
from worker_svc.sim import SimRunner, sim_config

SPEC = WorkerSpec("w0", 4096, 16, 4096)
BUDGET_MS = 60.0
# the committed SmolLM2 calibration's shape (data/cost_models), on a worker 5x as fast
FAST = CostModel(0.0177, 0.00124, 0.0, 1.376e-6, 1.121e-6).scaled(5.0)
SLOW_AFTER = 150  # steps; then every coefficient doubles


class VirtualRunner(SimRunner):
    """The sim model, with the step time its cost model gives instead of sleeping it."""

    def __init__(self) -> None:
        super().__init__(sim_config(SPEC.max_context), SPEC.num_blocks, SPEC.block_size, 0.0)
        self.cost = FAST
        self.last = 0.0

    def execute(self, items):
        work = [(i.start_position, len(i.token_ids), i.sample) for i in items]
        self.last = self.cost.predict(BatchShape.of(work))
        return super().execute(items)


class VirtualStream(InProcessStream):
    def __init__(self, runner: VirtualRunner) -> None:
        self.runner = runner
        self.session = Session(runner, SPEC.num_blocks)
        self.results: asyncio.Queue = asyncio.Queue()

    async def send(self, step) -> None:
        result = self.session.run(step)[0]
        result.forward_seconds = self.runner.last  # the worker's report: its virtual time
        self.results.put_nowait(result)


class VirtualClient(InProcessClient):
    def __init__(self) -> None:
        super().__init__(SPEC)
        self.runner = VirtualRunner()

    def open(self):
        return VirtualStream(self.runner)


class Record:
    """Per executed step: prompt tokens, predicted (when planned) and measured seconds."""

    def __init__(self, client: VirtualClient) -> None:
        self.client = client
        self.steps: list[tuple[int, float, float]] = []

    def __call__(self, index: int, step: Step, seconds: float) -> None:
        assert step.timer is not None
        prompt = sum(w.num_tokens for w in step.chunks)
        self.steps.append((prompt, step.timer.predicted(), seconds))
        if len(self.steps) == SLOW_AFTER:
            self.client.runner.cost = FAST.scaled(0.5)


def run_service(requests: int = 400, window: int = 1) -> tuple[Record, dict]:
    async def scenario() -> tuple[Record, dict]:
        client = VirtualClient()
        settings = SchedulerSettings(
            step_time_budget_ms=BUDGET_MS,
            step_time_window=window,
            token_budget=512,
            max_running=256,
            overlap=False,
            prefix_caching=False,
        )
        service = SchedulerService(settings, [client])
        service.on_step = record = Record(client)
        for i in range(requests):
            service.core.add(seq(f"r{i}", 120, 24))
        service.start()
        while service.core.seqs:  # however long the host takes (the hang guard bounds it)
            await asyncio.sleep(0.01)
        status = await service.Status(scheduler_pb2.StatusRequest(), None)
        service.watch_task.cancel()
        for loop in service.loops:
            loop.task.cancel()
        return record, status_dict(status)

    return asyncio.run(scenario())


@pytest.mark.usefixtures("hang_guard")
def test_a_worker_made_slower_takes_less_prompt_per_step_and_stays_near_the_budget() -> None:
    record, status = run_service()
    budget = BUDGET_MS / 1e3
    fast, slow = record.steps[50:SLOW_AFTER], record.steps[SLOW_AFTER + 60 :]
    assert len(slow) >= 40, len(record.steps)  # the slow phase ran long enough to judge
    fast_prompt = statistics.mean(p for p, _, _ in fast)
    slow_prompt = statistics.mean(p for p, _, _ in slow)
    assert slow_prompt < 0.7 * fast_prompt, (fast_prompt, slow_prompt)
    for phase in (fast, slow):
        with_prompt = [(pred, meas) for p, pred, meas in phase if p]
        assert all(pred <= budget * (1 + 1e-9) for pred, _ in with_prompt)  # as planned
        measured = sorted(meas / budget for _, meas in with_prompt)  # as it ran
        assert 0.9 <= statistics.median(measured) <= 1.05, measured
        assert measured[int(0.9 * len(measured))] <= 1.15, measured
    [worker] = status["workers"]
    assert status["step_time_budget_ms"] == BUDGET_MS
    assert worker["step_time_error_steps"] > 0 and worker["step_time_error_p90"] < 0.15
    assert "prediction error p50" in format_status(status)


@pytest.mark.usefixtures("hang_guard")
def test_held_over_a_window_single_steps_run_long_and_the_windows_average_the_budget() -> None:
    """--step-time-window 4 through the service: steps with prompt run past the budget (up to 4x),
    every 4 steps in a row stay within 4 budgets as planned and about that as they ran (the
    worker's own model learns the virtual times, and follows the slow-down halfway)."""
    window = 4
    record, status = run_service(requests=200, window=window)
    budget = BUDGET_MS / 1e3
    steps = record.steps[50:]
    assert len(steps) >= 100, len(record.steps)
    assert max(pred for _, pred, _ in steps) > 1.5 * budget  # the window let a step run long
    planned = [sum(pred for _, pred, _ in steps[i : i + window]) for i in range(len(steps) - 3)]
    assert max(planned) <= window * budget * 1.05, max(planned)  # as planned (progress aside)
    measured = sorted(
        sum(meas for _, _, meas in steps[i : i + window]) / (window * budget)
        for i in range(len(steps) - 3)
    )
    assert 0.8 <= statistics.median(measured) <= 1.05, measured
    assert status["step_time_window"] == window
    assert "on average over 4 steps" in format_status(status)
