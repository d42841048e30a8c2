"""The invariant checks catch broken bookkeeping, and a scheduler whose step loop breaks (an
invariant or any bug) exits loudly instead of leaving every request hanging."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from llmcommon.sampling import SamplingParams
from scheduler_svc.config import CoreConfig, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.invariants import InvariantError, check_invariants, check_step
from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.step import Step, Work
from scheduler_svc.worker_client import WorkerLost
from tests.inproc import InProcessClient
from tests.sim import seq, step

SPEC = WorkerSpec("w0", num_blocks=8, block_size=4, max_context=64)
SAMPLING = SamplingParams(temperature=0.0)


def busy_core() -> Scheduler:
    core = Scheduler(CoreConfig(token_budget=16), [SPEC])
    for rid in ("a", "b", "c"):
        core.add(seq(rid, 5, 20))
    step(core)
    step(core)
    check_invariants(core)  # a healthy core passes
    return core


def steal_block(core: Scheduler) -> None:
    pool = core.workers[0].kv.pool
    pool.tables["a"].append(pool.tables["b"][0])  # owned twice


def free_owned(core: Scheduler) -> None:
    pool = core.workers[0].kv.pool
    pool.free.append(pool.tables["a"][0])


def drop_kv(core: Scheduler) -> None:
    pool = core.workers[0].kv.pool
    pool.free.append(pool.tables["a"].pop())  # a's tokens lose their KV


def waiting_with_worker(core: Scheduler) -> None:
    core.add(seq("d", 6, 4))
    core.seqs["d"].worker = 0


@pytest.mark.parametrize("corrupt", [steal_block, free_owned, drop_kv, waiting_with_worker])
def test_broken_bookkeeping_is_caught(corrupt) -> None:
    core = busy_core()
    corrupt(core)
    with pytest.raises(InvariantError):
        check_invariants(core)


def stale_handle(core: Scheduler, planned: Step) -> None:
    planned.decode_handles[0] += 100  # a handle no request runs under


def another_workers_request(core: Scheduler, planned: Step) -> None:
    other = Scheduler(CoreConfig(), [SPEC])
    other.add(seq("x", 3, 3))
    [foreign] = other.schedule_all()
    planned.chunks.append(foreign.chunks[0])  # runs on another core's worker


def twice(core: Scheduler, planned: Step) -> None:
    planned.decodes.append(planned.decodes[0])
    planned.decode_handles.append(planned.decode_handles[0])


def short_table(core: Scheduler, planned: Step) -> None:
    rid = planned.decodes[0].request_id
    core.workers[0].kv.pool.tables[rid].pop()  # its last position has no block


def misplaced_grant(core: Scheduler, planned: Step) -> None:
    a = planned.decodes[0]
    planned.grants.append((a.handle, [core.workers[0].kv.pool.tables[a.request_id][0]]))


def granted_to_nobody(core: Scheduler, planned: Step) -> None:
    planned.grants.append((99, [0]))


def over_budget(core: Scheduler, planned: Step) -> None:
    a = planned.decodes[0]
    planned.chunks.append(Work(a, a.handle, 0, 16, False))  # 16 more tokens: 19 of 16


@pytest.mark.parametrize(
    "corrupt",
    [
        stale_handle,
        another_workers_request,
        twice,
        short_table,
        misplaced_grant,
        granted_to_nobody,
        over_budget,
    ],
)
def test_a_step_with_work_that_is_not_its_workers_own_is_caught(corrupt) -> None:
    core = busy_core()
    planned = core.schedule(0)
    check_step(core, planned)  # as planned: sound
    assert len(planned.decodes) == 3
    corrupt(core, planned)
    with pytest.raises(InvariantError):
        check_step(core, planned)


def test_a_request_left_prefilling_after_it_stopped_running_is_caught() -> None:
    core = busy_core()
    gone = core.workers[0].running.pop()
    core.workers[0].prefilling.add(gone)
    core.workers[0].kv.pool.release(gone.request_id)
    with pytest.raises(InvariantError, match="prefilling, but not running"):
        check_invariants(core)


def run_service_until_exit(break_it, exits: list[int]) -> None:
    async def scenario() -> None:
        service = SchedulerService(SchedulerSettings(), [InProcessClient(SPEC)])
        service.check_every_step = True
        service.core.add(seq("a", 5, 20))
        break_it(service)
        service.start()
        for _ in range(200):
            if exits:
                break
            await asyncio.sleep(0.01)
        service.watch_task.cancel()
        for loop in service.loops:
            loop.task.cancel()

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["invariant", "bug"])
def test_a_broken_step_loop_exits_the_scheduler_loudly(how, monkeypatch, caplog) -> None:
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)

    def break_it(service: SchedulerService) -> None:
        if how == "invariant":
            service.core.workers[0].kv.pool.free.append(0)  # block 0 free twice
        else:
            monkeypatch.setattr(service.core, "schedule", lambda index: 1 / 0)

    with caplog.at_level(logging.CRITICAL, logger="scheduler"):
        run_service_until_exit(break_it, exits)
    assert exits == [70]
    assert "worker-loop-0 crashed" in caplog.text
    assert ("InvariantError" if how == "invariant" else "ZeroDivisionError") in caplog.text


def test_tokens_recorded_before_a_worker_dies_reach_the_stream_no_gap_no_duplicate() -> None:
    """The worker's stream breaks on a send, right after a step's tokens were recorded but
    before the loop handed them over: the client still gets every token once, in order (the
    rest are recomputed on the other worker)."""

    class Dying(InProcessClient):
        def __init__(self, spec) -> None:
            super().__init__(spec)
            self.sends = 0

        def open(self):
            stream, client = super().open(), self
            send = stream.send

            async def dying_send(step) -> None:
                client.sends += 1
                if client.sends == 6:
                    raise WorkerLost("killed")
                await send(step)

            stream.send = dying_send
            return stream

    async def scenario() -> tuple[list[int], list[int]]:
        spec0, spec1 = WorkerSpec("w0", 64, 4, 256), WorkerSpec("w1", 60, 4, 256)
        service = SchedulerService(SchedulerSettings(), [Dying(spec0), InProcessClient(spec1)])
        service.check_every_step = True
        queue: asyncio.Queue = asyncio.Queue()
        service.streams["a"] = queue
        request = seq("a", 5, 30)
        request.sampling = SAMPLING
        service.core.add(request)
        service.start()
        tokens: list[int] = []
        while True:
            event = await asyncio.wait_for(queue.get(), 10)
            tokens += event.token_ids
            if event.finish_reason:
                break
        service.watch_task.cancel()
        for loop in service.loops:
            if loop is not None:
                loop.task.cancel()
        return tokens, list(request.output_ids)

    tokens, outputs = asyncio.run(scenario())
    assert len(tokens) == 30 and tokens == outputs


def test_a_worker_that_left_no_longer_limits_the_token_ids_accepted() -> None:
    """Token ids must be below every worker's vocabulary, but not a worker's that has left."""
    small, large = InProcessClient(SPEC), InProcessClient(WorkerSpec("w1", 8, 4, 64))
    small.info.vocab_size, large.info.vocab_size = 400, 49152
    service = SchedulerService(SchedulerSettings(), [small, large])
    assert service.vocab_size() == 400
    service.core.remove_worker(0)
    assert service.vocab_size() == 49152
