"""A worker's step at the end of its context (max_context = 32 here): position 31, the last,
is processed and samples a token; position 32 is refused, for that request alone, with
"position 32 is beyond the context of 32". The real runner (the tiny model) and the simulated
one refuse it too, if a caller gets past the step checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmcommon.sampling import GREEDY
from llmcommon.v1 import common_pb2, worker_pb2
from worker_svc.__main__ import make_runner
from worker_svc.loader import tiny_model
from worker_svc.runner import ModelRunner
from worker_svc.session import Session
from worker_svc.settings import WorkerSettings
from worker_svc.sim import SimRunner, sim_config
from worker_svc.work import WorkItem

CONTEXT, BS, BLOCKS = 32, 8, 12  # the pool (96 positions) outgrows the context
BEYOND = f"position {CONTEXT} is beyond the context of {CONTEXT}"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(torch.float32)


def runner(tiny, context: int = CONTEXT) -> ModelRunner:
    config, weights = tiny
    capped = dataclasses.replace(config, max_context=context)
    return ModelRunner(capped, weights, BLOCKS, BS, torch.float32, num_threads=1)


def start(handle: int, blocks: list[int], tokens: list[int], step: int = 1) -> worker_pb2.Step:
    """A new greedy request: placed, granted blocks, its prompt as one sampling chunk."""
    out = worker_pb2.Step(step=step)
    out.added.add(
        handle=handle, request_id=f"r{handle}", sampling=common_pb2.SamplingParams(temperature=0.0)
    )
    out.grants.add(handle=handle, blocks=blocks)
    out.chunks.add(handle=handle, token_ids=tokens, start_position=0, sample=True)
    return out


def prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 1000 for i in range(n)]


def decode_to_the_end(session: Session, handle: int) -> list[int]:
    """Decode request `handle` (its prompt CONTEXT - 1 long) at position CONTEXT - 1."""
    result, _, _ = session.run(worker_pb2.Step(step=2, decodes=[handle]))
    assert not result.error and not result.failed, result
    return list(result.tokens)


def test_a_decode_at_the_last_position_runs_and_one_past_it_fails_alone(tiny) -> None:
    s = Session(runner(tiny), BLOCKS)
    first, _, _ = s.run(start(0, [0, 1, 2, 3, 6], prompt(CONTEXT - 1)))  # blocks past it
    other, _, _ = s.run(start(1, [4, 5], prompt(9), step=2))
    assert not first.failed and not other.failed
    last = decode_to_the_end(s, 0)  # position 31: the context's last
    assert s.items[0].start_position == CONTEXT and len(last) == 1

    result, _, _ = s.run(worker_pb2.Step(step=3, decodes=[0, 1]))  # 0 at position 32
    assert not result.error and dict(result.failed) == {0: BEYOND}
    assert len(result.tokens) == 1  # request 1 decoded in the same step
    assert 0 not in s.items and s.used_blocks == 2  # request 0 forgotten, its blocks free


def test_the_last_position_samples_what_a_longer_context_samples_there(tiny) -> None:
    """The capped model's tables hold the last position whole: the token sampled there is the
    uncapped model's."""
    tokens = []
    for context in (CONTEXT, 2 * CONTEXT):
        s = Session(runner(tiny, context), BLOCKS)
        first, _, _ = s.run(start(0, [0, 1, 2, 3], prompt(CONTEXT - 1)))
        tokens.append(list(first.tokens) + decode_to_the_end(s, 0))
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize(
    ("start_position", "length", "problem"),
    [
        (0, CONTEXT, None),  # positions 0..31: the whole context in one chunk
        (0, CONTEXT + 1, BEYOND),
        (CONTEXT - 1, 1, None),  # a one-token chunk at the last position
        (CONTEXT - 1, 2, BEYOND),
    ],
)
def test_a_chunk_may_end_at_the_context_and_not_past_it(
    tiny, start_position: int, length: int, problem: str | None
) -> None:
    s = Session(runner(tiny), BLOCKS)
    step = start(0, [0, 1, 2, 3, 4], prompt(start_position + length))
    if start_position:  # the prompt's head first, without sampling; the tail in the test's step
        head, _, _ = s.run(start(0, [0, 1, 2, 3, 4], prompt(start_position)))
        assert not head.failed
        step = worker_pb2.Step(step=2)
        step.chunks.add(
            handle=0, token_ids=prompt(length), start_position=start_position, sample=True
        )
    result, _, _ = s.run(step)
    assert not result.error
    assert dict(result.failed) == ({0: problem} if problem else {})
    assert len(result.tokens) == (0 if problem else 1)


def item(end: int) -> WorkItem:
    """A decode whose token sits at position end - 1, with blocks enough for it."""
    blocks = list(range(-(-end // BS)))
    return WorkItem("r", [5], end - 1, blocks, sample=True, sampling=GREEDY)


@pytest.mark.parametrize("kind", ["model", "sim"])
def test_the_runners_process_the_last_position_and_refuse_the_one_past_it(tiny, kind) -> None:
    """Behind the step checks: a caller that skips them gets a ValueError, never an index
    error from the position tables (on a GPU a device-side assert that ends the process)."""
    run = runner(tiny) if kind == "model" else SimRunner(sim_config(CONTEXT), BLOCKS, BS, 0.0)
    assert len(run.execute([item(CONTEXT)])) == 1
    with pytest.raises(ValueError, match="beyond the"):
        run.execute([item(CONTEXT + 1)])


@pytest.mark.parametrize(("flag", "context"), [(CONTEXT, CONTEXT), (10**6, 2048)])
def test_the_max_context_flag_caps_the_models_context_never_raises_it(flag, context) -> None:
    settings = WorkerSettings(
        model="tiny", dtype="fp32", device="cpu", max_context=flag, kv_capacity=BLOCKS * BS
    )
    assert make_runner(settings).config.max_context == context
