"""A draft step through the scheduler's step loop (`WorkerLoop.complete`), the service's side of
the wire contract (protos/llmcommon/v1/worker.proto: Step.drafts, StepResult.emitted): the
tokens a worker answers for its drafts reach the request, cut at its stop token, and its
logprobs go with the tokens kept only; the step-time model learns the step's shape, drafts
included."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from llmcommon.sampling import SamplingParams
from llmcommon.v1 import common_pb2, worker_pb2
from scheduler_svc.config import WorkerSpec
from scheduler_svc.messages import step_message
from scheduler_svc.output import StepLogprobs, StepTokens
from scheduler_svc.sequence import Finish, Sequence
from scheduler_svc.service import SchedulerService
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.worker_loop import WorkerLoop
from tests import spec_sim
from tests.inproc import InProcessClient

SPEC = WorkerSpec("w0", 64, 4, 256)


def test_a_draft_steps_answer_reaches_the_request_cut_at_its_stop_with_its_logprobs() -> None:
    settings = SchedulerSettings(
        speculative="ngram", speculative_length="fixed", prompt_lookup_min=2, prompt_lookup_max=3
    )
    client = InProcessClient(SPEC)
    service = SchedulerService(settings, [client])
    core = service.core
    core.add_worker(SPEC)
    loop = WorkerLoop(core, settings, service, 0, client)
    stop = 6  # the model's 9th token: [12, 13, 9, 3, 5] then drafts from the prompt's 3 5 8 ...
    seq = Sequence("r", [3, 5, 8, 4], 40, eos_ids=frozenset({stop}))
    seq.sampling = SamplingParams(logprobs=0)
    core.add(seq)
    seen_tokens, seen_logprobs = [], 0
    for _ in range(40):
        step = core.schedule(0)
        if not step.has_work:
            break
        msg = step_message(1, step)
        assert len(msg.drafts) == len(step.drafts)
        tokens, emitted = spec_sim.run(step)
        result = worker_pb2.StepResult(
            tokens=tokens,
            emitted=emitted,
            forward_seconds=0.01,
            logprobs=[common_pb2.TokenLogprobs() for _ in tokens],
        )
        for event in loop.complete(step, result, time.perf_counter()):
            if isinstance(event, StepTokens):
                seen_tokens += [t for _, t in event]
            elif isinstance(event, StepLogprobs):
                seen_logprobs += len(event.items)
    assert seq.finish is Finish.STOP and seq.output_ids[-1] == stop
    assert seen_tokens == seq.output_ids and seen_logprobs == len(seq.output_ids)
    assert seq.output_ids == [12, 13, 9, 3, 5, 8, 7, 11, 6] and core.spec_drafts > 0


def test_the_step_model_learns_a_draft_steps_shape() -> None:
    from scheduler_svc.step_cost import BatchShape, step_shape

    step = SimpleNamespace(
        chunks=[], decodes=[], drafts=[SimpleNamespace(start=10, token_ids=[1, 2])]
    )
    assert step_shape(step) == BatchShape.draft(10, 2) == BatchShape(3, 3, 13, 36)


def at_a_draft():
    """A step loop on a fake worker, driven until the core plans a draft: (core, loop, the
    request, that step), the step not completed yet."""
    settings = SchedulerSettings(
        speculative="ngram", speculative_length="fixed", prompt_lookup_min=2, prompt_lookup_max=3
    )
    client = InProcessClient(SPEC)
    service = SchedulerService(settings, [client])
    core = service.core
    core.add_worker(SPEC)
    loop = WorkerLoop(core, settings, service, 0, client)
    core.add(seq := Sequence("r", [3, 5, 8, 4, 3, 5], 40))
    for _ in range(10):
        step = core.schedule(0)
        if step.drafts:
            break
        tokens, emitted = spec_sim.run(step)
        loop.complete(step, worker_pb2.StepResult(tokens=tokens), time.perf_counter())
    assert step.drafts
    return core, loop, seq, step


def test_a_worker_that_answers_no_draft_results_fails_the_step_instead_of_the_loop() -> None:
    """A worker built before drafts ignores them and answers the decodes' tokens only: the
    step's requests fail with an error naming the cause; the loop goes on."""
    core, loop, seq, step = at_a_draft()
    loop.complete(step, worker_pb2.StepResult(tokens=[7]), time.perf_counter())
    assert seq.finish is Finish.ERROR
    assert core.schedule(0).released == [step.drafts[0].handle]


@pytest.mark.parametrize("answer", ["too many", "too few tokens"])
def test_a_worker_whose_draft_answer_does_not_add_up_fails_the_step_instead_of_the_loop(
    answer: str,
) -> None:
    """A draft that emitted more than it could (or tokens that do not match the counts): the
    step's requests fail with the cause named; the loop goes on."""
    core, loop, seq, step = at_a_draft()
    tokens, emitted = spec_sim.run(step)
    if answer == "too many":
        emitted = [len(step.drafts[0].token_ids) + 2]
        tokens = tokens + [7]
    else:
        tokens = tokens[:-1]
    result = worker_pb2.StepResult(tokens=tokens, emitted=emitted)
    loop.complete(step, result, time.perf_counter())
    assert seq.finish is Finish.ERROR
    assert "draft" in result.error


def test_llmserve_status_shows_the_proposer_and_how_its_drafts_did() -> None:
    from llmserve.status_text import speculative_text

    assert speculative_text({"speculative": "off"}) == ""
    line = speculative_text(
        {
            "speculative": "ngram",
            "num_speculative_tokens": 5,
            "speculative_length": "auto",
            "spec_drafts": 10,
            "spec_draft_tokens": 40,
            "spec_accepted_tokens": 30,
        }
    )
    want = "  speculative ngram (up to 5, auto; 10 drafts, acceptance 75%, mean length 4.00)"
    assert line == want
