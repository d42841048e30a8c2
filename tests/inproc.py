"""The scheduler core driving a worker's step session in-process: the same step messages the
service sends over gRPC, executed by the simulated model, with or without overlap."""

from __future__ import annotations

from collections import deque

from scheduler_svc import invariants
from scheduler_svc.core import Scheduler
from scheduler_svc.messages import step_message
from scheduler_svc.step import Step
from worker_svc.session import Session
from worker_svc.sim import SimRunner, sim_config


class InProcessWorker:
    def __init__(self, core: Scheduler, index: int, overlap: bool) -> None:
        spec = core.workers[index].spec
        runner = SimRunner(sim_config(spec.max_context), spec.num_blocks, spec.block_size, 0.0)
        self.core, self.index = core, index
        self.session = Session(runner, spec.num_blocks)
        self.depth = 2 if overlap else 1
        self.inflight: deque[tuple[Step, object]] = deque()

    def tick(self) -> bool:
        """Plan (and 'send') one step if there is room in flight, else complete the oldest.
        Returns whether anything happened."""
        if len(self.inflight) < self.depth:
            step = self.core.schedule(self.index)
            invariants.check_invariants(self.core)
            invariants.check_step(self.core, step)
            if step.has_work or step.released:
                result, _, _ = self.session.run(step_message(self.core.steps, step))
                self.inflight.append((step, result))
                return True
        if not self.inflight:
            return False
        step, result = self.inflight.popleft()
        assert not result.error and not result.failed, (result.error, dict(result.failed))
        self.core.complete(step, list(result.tokens))
        invariants.check_invariants(self.core)
        return True


def run_all(core: Scheduler, overlap: bool, limit: int = 5000) -> None:
    workers = [InProcessWorker(core, i, overlap) for i in range(len(core.workers))]
    for _ in range(limit):
        busy = [w.tick() for w in workers if core.workers[w.index].healthy]
        if not any(busy) and not core.waiting:
            return
    raise AssertionError("the workload did not finish")


class InProcessClient:
    """A worker client whose step stream is an in-process session of the simulated model:
    the scheduler service's loops run against it without gRPC (tests)."""

    def __init__(self, spec, eos_ids=(2,), static: bool = True) -> None:
        from llmcommon.v1 import worker_pb2

        self.target = f"inproc:{spec.name}"
        self.static = static
        self.spec_ = spec
        self.info = worker_pb2.WorkerInfo(name=spec.name, eos_token_ids=list(eos_ids))
        self.last_forward = self.forward_seconds = self.idle_seconds = 0.0
        self.step_bytes = 0
        self.unreachable_since = self.silent_since = None

    def spec(self):
        return self.spec_

    def open(self):
        return InProcessStream(self.spec_)

    async def serving(self, timeout: float = 1.0) -> bool:
        return True


class InProcessStream:
    def __init__(self, spec) -> None:
        import asyncio

        runner = SimRunner(sim_config(spec.max_context), spec.num_blocks, spec.block_size, 0.0)
        self.session = Session(runner, spec.num_blocks)
        self.results: asyncio.Queue = asyncio.Queue()

    async def send(self, step) -> None:
        self.results.put_nowait(self.session.run(step)[0])

    async def receive(self, timeout: float):
        import asyncio

        await asyncio.sleep(0.001)  # a step takes a moment: other loops and handlers run
        return await self.results.get()

    def check(self) -> None:
        pass

    def cancel(self) -> None:
        pass
