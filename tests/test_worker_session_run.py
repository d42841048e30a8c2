"""What a worker's session answers for a step (`Session.run`), on the simulated model: the step
it answers, the idle time before it, the forward time of each execution (a decode run's summed),
each request's count of sampled tokens, logprobs only where asked, an error named by its type,
and a decode run whose every request runs out of room answered as failures, not as an error."""

from __future__ import annotations

import pytest

from llmcommon.v1 import common_pb2, worker_pb2
from tests.test_worker_step_time import FakeClock
from worker_svc import session as session_module
from worker_svc.session import Session
from worker_svc.sim import SimRunner, sim_config

BLOCKS, BS = 16, 4


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(session_module.time, "perf_counter", clock)
    return clock


def session(clock: FakeClock | None = None, execute_s: float = 0.0) -> Session:
    """A session on the simulated model; each execution takes `execute_s` on `clock`."""
    runner = SimRunner(sim_config(64), BLOCKS, BS, 0.0)
    if clock is not None:
        execute = runner.execute

        def timed(items):
            clock.now += execute_s
            return execute(items)

        runner.execute = timed
    return Session(runner, BLOCKS)


def prompt_step(step: int = 0, logprobs: int | None = None, blocks=((0, 1), (2, 3))):
    """Requests 1 and 2, three prompt tokens each, sampled greedily."""
    first = worker_pb2.Step(step=step)
    sampling = common_pb2.SamplingParams(temperature=0.0)
    if logprobs is not None:
        sampling.logprobs = logprobs
    for handle, table in zip((1, 2), blocks, strict=True):
        first.added.add(handle=handle, request_id=f"r{handle}", sampling=sampling)
        first.chunks.add(handle=handle, token_ids=[5 + handle, 17, 42], sample=True)
        first.grants.add(handle=handle, blocks=list(table))
    return first


def test_a_result_answers_its_step_and_the_idle_time_since_the_last(clock) -> None:
    s = session(clock)
    first, _, _ = s.run(prompt_step(step=7))
    assert first.step == 7 and first.idle_seconds == 0.0  # nothing ran before it
    clock.now += 2.5
    second, _, _ = s.run(worker_pb2.Step(step=8, decodes=[1, 2]))
    assert second.step == 8 and second.idle_seconds == 2.5
    idle, _, seconds = s.run(worker_pb2.Step(step=9))  # nothing to execute
    assert idle.forward_seconds == seconds == 0.0 and not idle.tokens


def test_a_run_times_and_shapes_each_execution(clock) -> None:
    s = session(clock, execute_s=0.5)
    s.run(prompt_step())
    result, _, seconds = s.run(worker_pb2.Step(step=1, decodes=[1, 2], repeat=3))
    assert not result.error and len(result.tokens) == 6
    assert result.forward_seconds == seconds == 1.5
    assert [(shape.tokens, took) for shape, took in s.executions] == [(2, 0.5)] * 3


def test_each_request_counts_the_tokens_it_sampled_through_a_run() -> None:
    s = session()
    s.run(prompt_step())
    s.run(worker_pb2.Step(step=1, decodes=[1, 2]))
    s.run(worker_pb2.Step(step=2, decodes=[1, 2], repeat=3))
    assert [s.items[h].sample_index for h in (1, 2)] == [5, 5]


@pytest.mark.parametrize("asked", [None, 2])
def test_logprobs_come_for_each_token_only_where_asked(asked: int | None) -> None:
    s = session()
    result, _, _ = s.run(prompt_step(logprobs=asked))
    run, _, _ = s.run(worker_pb2.Step(step=1, decodes=[1, 2]))
    for r in (result, run):
        assert len(r.tokens) == 2
        if asked is None:
            assert not r.logprobs
        else:
            assert len(r.logprobs) == len(r.tokens)
            assert all(len(lp.top_ids) == asked and lp.logprob <= 0 for lp in r.logprobs)


def test_an_error_is_named_by_its_type() -> None:
    s = session()
    s.run(prompt_step())
    result, _, _ = s.run(worker_pb2.Step(step=1, decodes=[1], repeat=10_000))
    assert result.error.startswith("ValueError: ") and not result.tokens


@pytest.mark.parametrize("short", [(1,), (1, 2)])
def test_requests_out_of_room_in_a_run_fail_alone_and_the_rest_run_on(short) -> None:
    """A table of one block (4 positions) ends a run of 4 from position 3 after its first
    execution: request 1 fails whole, request 2 (after it) runs all 4 executions, or, when
    both are short, the step answers both failed, not an error."""
    tables = [(0,) if h in short else (2, 3, 4) for h in (1, 2)]
    s = session()
    s.run(prompt_step(blocks=tables))
    result, _, _ = s.run(worker_pb2.Step(step=1, decodes=[1, 2], repeat=4))
    assert not result.error and sorted(result.failed) == list(short)
    assert len(result.tokens) == (0 if len(short) == 2 else 4)
