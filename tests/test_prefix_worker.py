"""Prefix caching on the worker: a request reads blocks written by requests before it (shared,
never copied), starts computing after them, and may write only into blocks that it alone holds.
The KV it reads is what recomputing its prefix would write, and its outputs are those of a
request computed from scratch."""

from __future__ import annotations

import torch

from llmcommon.v1 import common_pb2, worker_pb2
from scheduler_svc.config import CoreConfig, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.sequence import Sequence
from tests.inproc import run_all
from tests.model_support import model, one_torch_thread  # noqa: F401  (autouse fixture)
from worker_svc.runner import ModelRunner
from worker_svc.session import Session
from worker_svc.sim import SimRunner, sim_config
from worker_svc.work import WorkItem

BLOCKS, BS = 16, 4


def add(
    step: worker_pb2.Step,
    handle: int,
    tokens: list[int],
    blocks: list[int],
    shared: list[int] | None = None,
    **sampling,
) -> None:
    """A new request: its cached prefix read from `shared` blocks, the rest of `tokens` computed
    in `blocks` of its own, as one sampling chunk."""
    cached = tokens[: len(shared or []) * BS]
    settings = common_pb2.SamplingParams(**{"temperature": 0.0, **sampling})
    added = step.added.add(handle=handle, request_id=f"r{handle}", sampling=settings)
    added.cached_token_ids.extend(cached)
    if shared:
        step.shared.add(handle=handle, blocks=shared)
    step.grants.add(handle=handle, blocks=blocks)
    rest = tokens[len(cached) :]
    step.chunks.add(handle=handle, token_ids=rest, start_position=len(cached), sample=True)


def sim_session() -> Session:
    return Session(SimRunner(sim_config(64), BLOCKS, BS, 0.0), BLOCKS)


def test_a_request_reads_another_requests_full_blocks_and_computes_only_the_rest() -> None:
    s = sim_session()
    first = worker_pb2.Step(step=1)
    add(first, 0, list(range(10, 20)), [0, 1, 2])  # 10 tokens: blocks 0, 1 full, 2 partly
    s.run(first)
    second = worker_pb2.Step(step=2, decodes=[0])
    add(second, 1, list(range(10, 18)) + [5, 6, 7], [3], shared=[0, 1])
    result, shape, _ = s.run(second)
    assert not result.failed and not result.error and len(result.tokens) == 2
    assert shape.tokens == 3 + 1  # the 3 new tokens of request 1 and request 0's decode
    assert s.items[1].block_table == [0, 1, 3] and s.items[1].start_position == 11
    assert s.holders[0] == s.holders[1] == {0, 1}
    assert result.kv.used_blocks == 4  # a shared block counts once
    assert result.kv.written_positions == 11 + 3  # request 0's 11, request 1's own 3


def test_writing_into_a_block_another_request_holds_fails_that_request_alone() -> None:
    s = sim_session()
    first = worker_pb2.Step(step=1)
    add(first, 0, list(range(10, 16)), [0, 1])  # 6 tokens: block 1 half filled
    add(first, 1, [7, 8], [2])
    s.run(first)
    step = worker_pb2.Step(step=2, decodes=[0, 1])
    add(step, 2, list(range(10, 18)) + [5], [3], shared=[0, 1])  # as if block 1 were full
    result, _, _ = s.run(step)
    assert list(result.failed) == [0]  # its decode would write position 6, in block 1
    assert "position 6 into block 1, which request(s) [2] also hold" in result.failed[0]
    assert len(result.tokens) == 2 and 0 not in s.items  # requests 2 and 1 ran
    assert s.holders[0] == s.holders[1] == {2} and s.items[2].start_position == 9


def test_a_chunk_into_a_block_another_request_holds_fails_alone() -> None:
    s = sim_session()
    first = worker_pb2.Step(step=1)
    first.added.add(handle=0, request_id="r0")
    first.grants.add(handle=0, blocks=[0, 1])
    first.chunks.add(handle=0, token_ids=[10, 11, 12, 13, 14], start_position=0)
    s.run(first)
    step = worker_pb2.Step(step=2)
    add(step, 1, list(range(10, 18)) + [5], [2], shared=[0, 1])
    step.chunks.add(handle=0, token_ids=[15, 16, 17], start_position=5, sample=True)
    result, _, _ = s.run(step)
    assert list(result.failed) == [0] and "into block 1" in result.failed[0]
    assert len(result.tokens) == 1


def test_shared_blocks_must_hold_the_cached_prefix_exactly_and_lie_in_the_pool() -> None:
    s = sim_session()
    first = worker_pb2.Step(step=1)
    add(first, 0, list(range(10, 18)), [0, 1])
    s.run(first)
    step = worker_pb2.Step(step=2)
    short = step.added.add(handle=1, request_id="r1")
    short.cached_token_ids.extend(range(10, 16))  # 6 tokens in one block of 4
    step.shared.add(handle=1, blocks=[0])
    step.added.add(handle=2, request_id="r2").cached_token_ids.extend(range(10, 14))
    step.shared.add(handle=2, blocks=[BLOCKS])
    step.shared.add(handle=0, blocks=[1])  # request 0 was not added now
    result, _, _ = s.run(step)
    assert "6 tokens, but its 1 shared blocks hold 4 positions" in result.failed[1]
    assert "outside the pool" in result.failed[2]
    assert "not added in this step" in result.failed[0]
    assert s.used_blocks == 0 and result.kv.free_blocks == BLOCKS


def test_releasing_one_holder_keeps_the_block_for_the_other() -> None:
    s = sim_session()
    first = worker_pb2.Step(step=1)
    add(first, 0, list(range(10, 18)), [0, 1, 2])
    s.run(first)
    second = worker_pb2.Step(step=2)
    add(second, 1, list(range(10, 18)) + [5], [3], shared=[0, 1])
    s.run(second)
    result, _, _ = s.run(worker_pb2.Step(step=3, released=[0], decodes=[1]))
    assert not result.failed and len(result.tokens) == 1
    assert s.holders == {0: {1}, 1: {1}, 3: {1}}
    assert result.kv.used_blocks == 3 and result.kv.written_positions == 8 + 2
    grab = worker_pb2.Step(step=4)
    add(grab, 2, [4, 4], [0])  # still request 1's: not free
    result, _, _ = s.run(grab)
    assert "block 0 belongs to another request" in result.failed[2]
    s.run(worker_pb2.Step(step=5, released=[1]))
    assert s.holders == {} and s.report().written_positions == 0


def test_the_cached_prefix_joins_the_penalty_history() -> None:
    s = sim_session()
    first = worker_pb2.Step(step=1)
    add(first, 0, list(range(10, 18)), [0, 1])
    s.run(first)
    second = worker_pb2.Step(step=2)
    add(second, 1, list(range(10, 18)) + [5], [2], shared=[0, 1], repetition_penalty=1.3)
    add(second, 2, list(range(10, 18)) + [5], [3], shared=[0, 1])
    s.run(second)
    assert s.items[1].history == list(range(10, 18)) + [5]
    assert s.items[2].history == []  # not penalized: no history kept


# ---- the real (tiny, random) model: what a shared block holds ---------------------------------


def tiny_runner() -> ModelRunner:
    config, weights = model("tiny")
    return ModelRunner(config, weights, num_blocks=BLOCKS, block_size=BS, dtype=torch.float32)


def greedy(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, **kw)


def test_a_request_on_shared_blocks_computes_what_it_computes_from_scratch() -> None:
    gen = torch.Generator().manual_seed(14)
    prompt = torch.randint(0, 49152, (13,), generator=gen).tolist()  # P: 3 full blocks + 1
    other = torch.randint(0, 49152, (6,), generator=gen).tolist()
    k = 2
    b_tokens = prompt[: k * BS] + other
    runner = tiny_runner()
    s = Session(runner, BLOCKS)
    first = worker_pb2.Step(step=1)
    add(first, 0, prompt, [5, 9, 2, 7])
    s.run(first)
    second = worker_pb2.Step(step=2, decodes=[0])
    add(second, 1, b_tokens, [11, 3, 4], shared=[5, 9])
    shared_tokens = [s.run(second)[0].tokens[0]]
    for n in range(3):
        shared_tokens.append(s.run(worker_pb2.Step(step=3 + n, decodes=[1]))[0].tokens[0])
    fresh = Session(tiny_runner(), BLOCKS)
    start = worker_pb2.Step(step=1)
    add(start, 0, b_tokens, [0, 1, 2, 3, 4])
    fresh_tokens = [fresh.run(start)[0].tokens[0]]
    for n in range(3):
        fresh_tokens.append(fresh.run(worker_pb2.Step(step=2 + n, decodes=[0]))[0].tokens[0])
    assert shared_tokens == fresh_tokens
    # the logits of every computed position, shared blocks against a fresh pool
    on_shared = runner.compute_logits(
        [WorkItem("b", other, k * BS, [5, 9, 11, 3])], all_positions=True
    )
    scratch = tiny_runner().compute_logits(
        [WorkItem("b", b_tokens, 0, [0, 1, 2, 3, 4])], all_positions=True
    )[k * BS :]
    torch.testing.assert_close(on_shared, scratch, atol=1e-5, rtol=0)


def test_a_shared_block_holds_exactly_what_recomputing_its_prefix_writes() -> None:
    gen = torch.Generator().manual_seed(15)
    prompt = torch.randint(0, 49152, (13,), generator=gen).tolist()
    k = 2
    whole = tiny_runner()
    whole.compute_logits([WorkItem("a", prompt, 0, [5, 9, 2, 7])])  # P in one chunk
    alone = tiny_runner()
    alone.compute_logits([WorkItem("p", prompt[: k * BS], 0, [5, 9])])  # its prefix alone
    for layer in range(whole.config.num_layers):
        for which in ("k", "v"):
            written = whole.pool.blocks(layer, which)[[5, 9]]
            recomputed = alone.pool.blocks(layer, which)[[5, 9]]
            torch.testing.assert_close(written, recomputed, atol=1e-5, rtol=0)


# ---- the core's steps, as the service sends them ---------------------------------------------


def shared_prefix_workload(caching: bool, overlap: bool) -> tuple[dict[str, list[int]], object]:
    """Requests that start alike, arriving while others run, on one worker of 4-position blocks:
    what each generated, and the core's snapshot at the end."""
    core = Scheduler(
        CoreConfig(token_budget=16, prefix_caching=caching), [WorkerSpec("w0", 64, BS, 256)]
    )
    system = [(7 * i) % 400 + 3 for i in range(22)]
    requests = [Sequence(f"r{i}", system + [500 + i] * (i % 3 + 1), 6) for i in range(6)]
    for request in requests[:2]:
        core.add(request)
    run_all(core, overlap)
    for request in requests[2:]:
        core.add(request)
    run_all(core, overlap)
    return {r.request_id: r.output_ids for r in requests}, core.snapshot()


def test_the_cores_shared_blocks_run_on_the_worker_and_change_no_output() -> None:
    for overlap in (False, True):
        cached, snap = shared_prefix_workload(caching=True, overlap=overlap)
        plain, plain_snap = shared_prefix_workload(caching=False, overlap=overlap)
        assert cached == plain and all(len(out) == 6 for out in cached.values())
        [kv], [plain_kv] = snap.workers, plain_snap.workers
        assert kv.hit_tokens >= 4 * 20 and plain_kv.hit_tokens == 0  # 5 of them: 20 cached
        assert kv.prompt_tokens == plain_kv.prompt_tokens
