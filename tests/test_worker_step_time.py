"""The step time a worker reports is the execution of its batch (forward and sampling: what the
scheduler's step-time model predicts from the batch's shape), not the bookkeeping before it
(adding requests, compiling a grammar, checking blocks)."""

from __future__ import annotations

from llmcommon.v1 import common_pb2, worker_pb2
from worker_svc import session as session_module
from worker_svc.session import Session
from worker_svc.sim import SimRunner, sim_config

BLOCKS, BS = 16, 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def one_prompt_step() -> worker_pb2.Step:
    step = worker_pb2.Step(step=1)
    settings = common_pb2.SamplingParams(temperature=0.0)
    step.added.add(handle=1, request_id="r1", sampling=settings)
    step.grants.add(handle=1, blocks=[0, 1])
    step.chunks.add(handle=1, start_position=0, token_ids=[5, 6, 7], sample=True)
    return step


def test_forward_seconds_time_the_execution_not_the_changes_before_it(monkeypatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(session_module.time, "perf_counter", clock)
    runner = SimRunner(sim_config(64), BLOCKS, BS, 0.0)
    execute, apply = runner.execute, Session.apply

    def slow_apply(self, step, failed):  # e.g. a grammar compiled for a request added
        clock.now += 1.0
        return apply(self, step, failed)

    def timed_execute(items):
        clock.now += 0.25
        return execute(items)

    monkeypatch.setattr(Session, "apply", slow_apply)
    runner.execute = timed_execute
    result, shape, seconds = Session(runner, BLOCKS).run(one_prompt_step())
    assert not result.error and not result.failed and len(result.tokens) == 1
    assert result.forward_seconds == seconds == 0.25
