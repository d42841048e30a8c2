"""A worker checks every step it is sent: a request with bad input, or one that breaks the model,
fails alone and is forgotten; the other requests of its step run and keep their outputs."""

from __future__ import annotations

import math

from llmcommon.v1 import common_pb2, worker_pb2
from scheduler_svc.config import CoreConfig, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.messages import step_message
from scheduler_svc.sequence import Finish
from tests.sim import check_invariants, seq
from worker_svc.session import Session
from worker_svc.sim import SimRunner, sim_config, sim_token

BLOCKS, BS = 8, 4


def session(runner=None) -> Session:
    runner = runner or SimRunner(sim_config(64), BLOCKS, BS, 0.0)
    return Session(runner, BLOCKS)


def start(handle: int, blocks: list[int], tokens: list[int], **sampling) -> worker_pb2.Step:
    """A new request: placed, granted blocks, its prompt as one sampling chunk."""
    step = worker_pb2.Step(step=1)
    step.added.add(
        handle=handle,
        request_id=f"r{handle}",
        sampling=common_pb2.SamplingParams(**{"temperature": 0.0, **sampling}),
    )
    step.grants.add(handle=handle, blocks=blocks)
    step.chunks.add(handle=handle, token_ids=tokens, start_position=0, sample=True)
    return step


def merge(*steps: worker_pb2.Step) -> worker_pb2.Step:
    out = worker_pb2.Step(step=1)
    for s in steps:
        out.MergeFrom(s)
    return out


def test_a_good_step_runs_and_reports_no_failure() -> None:
    result, _, _ = session().run(start(0, [0, 1], [5, 6, 7]))
    assert not result.error and not result.failed and len(result.tokens) == 1


def test_a_block_owned_by_another_request_fails_only_the_request_it_was_granted_to() -> None:
    s = session()
    first, _, _ = s.run(merge(start(0, [0, 1], [5, 6, 7]), start(1, [2], [8, 9])))
    assert not first.failed and len(first.tokens) == 2
    thief = start(2, [1, 3], [4, 4])  # block 1 is request 0's
    decodes = worker_pb2.Step(step=2, decodes=[0, 1])
    result, _, _ = s.run(merge(thief, decodes))
    assert set(result.failed) == {2} and "belongs to another request" in result.failed[2]
    assert len(result.tokens) == 2  # requests 0 and 1 decoded
    assert 2 not in s.items and 3 not in s.holders  # forgotten, nothing of it kept
    assert s.used_blocks == 3 and result.kv.free_blocks == BLOCKS - 3


def test_a_grant_beyond_the_pool_never_makes_free_blocks_negative() -> None:
    s = session()
    whole = start(0, list(range(BLOCKS)), [5, 6])
    s.run(whole)
    result, _, _ = s.run(start(1, list(range(BLOCKS)), [5, 6]))
    assert set(result.failed) == {1} and result.kv.free_blocks == 0
    result, _, _ = s.run(start(2, [BLOCKS + 3], [5]))
    assert "outside the pool" in result.failed[2] and result.kv.free_blocks == 0


def test_token_ids_outside_the_vocabulary_fail_that_request_alone() -> None:
    s = session()
    vocab = s.vocab_size
    result, _, _ = s.run(merge(start(0, [0], [5, 6]), start(1, [1], [vocab])))
    assert set(result.failed) == {1} and f"token id {vocab}" in result.failed[1]
    assert result.tokens == [sim_token_of(0, [5, 6])]


def sim_token_of(handle: int, tokens: list[int]) -> int:
    from worker_svc.work import WorkItem

    return sim_token(WorkItem(f"r{handle}", tokens, 0, []))


def test_bad_sampling_values_fail_that_request_alone() -> None:
    s = session()
    steps = [start(1, [1], [5], temperature=math.nan), start(2, [2], [5], top_p=1.5)]
    result, _, _ = s.run(merge(start(0, [0], [5, 6]), *steps))
    assert set(result.failed) == {1, 2} and len(result.tokens) == 1
    assert "temperature" in result.failed[1] and "top_p" in result.failed[2]


def test_a_chunk_beyond_its_own_blocks_or_an_unknown_decode_fails_alone() -> None:
    s = session()
    s.run(start(0, [0], [5, 6]))
    result, _, _ = s.run(merge(start(1, [1], [5] * (BS + 1)), worker_pb2.Step(decodes=[0, 9])))
    assert set(result.failed) == {1, 9} and len(result.tokens) == 1
    assert "do not reach" in result.failed[1] and result.failed[9] == "unknown handle"


class Breaks(SimRunner):
    """A model that raises whenever a batch holds the request `poison`."""

    def execute(self, items):
        if any(i.request_id == "r1" for i in items):
            raise RuntimeError("the model broke")
        return super().execute(items)


def test_a_request_that_breaks_the_model_fails_alone_and_the_rest_of_its_batch_runs() -> None:
    s = session(Breaks(sim_config(64), BLOCKS, BS, 0.0))
    result, _, _ = s.run(merge(start(0, [0], [5, 6]), start(1, [1], [5]), start(2, [2], [7])))
    assert set(result.failed) == {1} and "the model broke" in result.failed[1]
    assert result.tokens == [sim_token_of(0, [5, 6]), sim_token_of(2, [7])]
    assert not result.error and sorted(s.items) == [0, 2]


def test_the_core_fails_only_the_requests_the_worker_could_not_run() -> None:
    core = Scheduler(CoreConfig(), [WorkerSpec("w0", 64, 4, 64)])
    a, b, c = seq("a", 3, 4), seq("b", 3, 4), seq("c", 3, 4)
    for r in (a, b, c):
        core.add(r)
    step = core.schedule(0)
    result, _, _ = Session(SimRunner(sim_config(64), 16, 4, 0.0), 16).run(step_message(1, step))
    failed = {b.handle: "token id 99999 is outside the vocabulary"}
    tokens = [t for t in result.tokens][:2]  # as if b's row were missing
    core.fail_items(step, failed, "w0")
    core.complete(step, tokens)
    assert b.finish is Finish.ERROR and "w0 could not run" in b.error and "vocabulary" in b.error
    assert len(a.output_ids) == len(c.output_ids) == 1 and not b.output_ids
    core.schedule(0)  # b leaves and frees its KV at the next step
    check_invariants(core)
    assert core.workers[0].kv.pool.allocated("b") == 0


def test_a_request_planned_twice_in_one_step_fails_alone() -> None:
    """decodes [0, 0, 1] had returned 3 tokens for 2 requests, request 0 moved two positions
    over KV never written (internal-services sweep M1); a chunk and a decode of one request
    alike."""
    s = session()
    s.run(merge(start(0, [0], [5, 6]), start(1, [1], [7, 8]), start(2, [2], [4])))
    result, _, _ = s.run(worker_pb2.Step(step=2, decodes=[0, 0, 1]))
    assert set(result.failed) == {0} and "planned twice" in result.failed[0]
    assert len(result.tokens) == 1 and 0 not in s.items
    chunk_and_decode = worker_pb2.Step(step=3, decodes=[2])
    chunk_and_decode.chunks.add(handle=2, token_ids=[9], start_position=1, sample=True)
    result, _, _ = s.run(chunk_and_decode)
    assert set(result.failed) == {2} and not result.tokens
