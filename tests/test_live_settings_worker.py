"""A worker drops a request's reserved, unwritten blocks when a step trims its table (the
scheduler switched from reserve to paged): another request may be granted them next."""

from __future__ import annotations

from llmcommon.v1 import common_pb2, worker_pb2
from worker_svc.session import Session
from worker_svc.sim import SimRunner, sim_config

BLOCKS, BS = 8, 4


def reserved_request() -> Session:
    """Request 0: a 3-token prompt in a reservation of 6 blocks (24 positions)."""
    s = Session(SimRunner(sim_config(64), BLOCKS, BS, 0.0), BLOCKS)
    step = worker_pb2.Step(step=1)
    step.added.add(handle=0, request_id="r0", sampling=common_pb2.SamplingParams(temperature=0.0))
    step.grants.add(handle=0, blocks=[0, 1, 2, 3, 4, 5])
    step.chunks.add(handle=0, token_ids=[5, 6, 7], start_position=0, sample=True)
    assert not s.run(step)[0].failed
    return s


def test_a_trim_frees_the_unwritten_blocks_for_another_request() -> None:
    s = reserved_request()
    step = worker_pb2.Step(step=2, decodes=[0])
    step.trims.add(handle=0, keep=1)
    step.added.add(handle=1, request_id="r1", sampling=common_pb2.SamplingParams(temperature=0.0))
    step.grants.add(handle=1, blocks=[1, 2])  # were request 0's
    step.chunks.add(handle=1, token_ids=[9, 9, 9, 9, 9], start_position=0, sample=True)
    result, _, _ = s.run(step)
    assert not result.failed and len(result.tokens) == 2
    assert s.items[0].block_table == [0] and result.kv.free_blocks == BLOCKS - 3


def test_a_trim_that_would_drop_written_positions_fails_that_request_alone() -> None:
    s = reserved_request()
    step = worker_pb2.Step(step=2)
    step.trims.add(handle=0, keep=0)  # positions 0..2 are written
    result, _, _ = s.run(step)
    assert "written" in result.failed[0] and 0 not in s.items
    assert result.kv.free_blocks == BLOCKS
