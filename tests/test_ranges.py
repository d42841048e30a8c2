"""One range per sampling setting (llmcommon/ranges.py), applied by the gateway's
validation, the scheduler's submit checks and the worker's step checks alike: a value one layer
takes, every layer takes, and a value that sampling cannot do (a repetition penalty that
overflows the logits) is refused at the door, not failed by the worker's batch."""

from __future__ import annotations

import math

import pytest

from gateway.validation import InvalidRequest, validate
from llmcommon.ranges import (
    FREQUENCY_PENALTY,
    LOGIT_BIAS,
    MIN_P,
    PRESENCE_PENALTY,
    REPETITION_PENALTY,
    TEMPERATURE,
    TOP_P,
    Range,
)
from llmcommon.sampling import SamplingParams
from llmcommon.v1 import common_pb2, scheduler_pb2, worker_pb2
from scheduler_svc.submit_checks import InvalidSubmission, submission_of
from worker_svc.session import Session
from worker_svc.sim import SimRunner, sim_config

VOCAB = 64
PROBES = [
    -3.0, -2.0, -1.0, -1e-9, 0.0, 1e-38, 1e-9, 1e-5, 1e-4, 0.5, 1.0, 1.01, 2.0, 2.5, 100.0,
    150.0, 1000.0, 1e4, 1e5, 1e38, math.inf, -math.inf, math.nan,
]  # fmt: skip
SCALARS = [TEMPERATURE, TOP_P, MIN_P, PRESENCE_PENALTY, FREQUENCY_PENALTY, REPETITION_PENALTY]


def f32(value: float) -> float:
    """The value as a protobuf float field holds it."""
    return common_pb2.SamplingParams(min_p=value).min_p


def gateway_takes(name: str, value: float, **others: object) -> bool:
    """The gateway validates the request's SamplingParams (the same check the scheduler and
    the worker run)."""
    try:
        validate("hi", None, SamplingParams(**{name: value}, **others),  # type: ignore[arg-type]
                 max_context=64, default_max_tokens=8)  # fmt: skip
    except InvalidRequest:
        return False
    return True


def submit_problem(
    prompt: list[int], resumed: list[int], sampling: common_pb2.SamplingParams, vocab: int
) -> str | None:
    """What the scheduler's door says of a Submit (None: it takes it)."""
    submit = scheduler_pb2.SubmitRequest(
        prompt_token_ids=prompt, resume_token_ids=resumed, sampling=sampling
    )
    try:
        submission_of(submit, vocab)
    except InvalidSubmission as err:
        return str(err)
    return None


def step_problem(sampling: common_pb2.SamplingParams, vocab: int) -> str | None:
    """What the worker's door says of a request placed with these settings (None: it takes
    it); its vocabulary is the simulated model's, larger than `vocab`."""
    session = Session(SimRunner(sim_config(64), 4, 16, 0.0), 4)
    assert session.vocab_size >= vocab
    return session.add(worker_pb2.Added(handle=1, request_id="r", sampling=sampling))


def scheduler_takes(name: str, value: float) -> bool:
    params = common_pb2.SamplingParams(max_tokens=8, **{name: value})
    return submit_problem([1, 2], [], params, VOCAB) is None


def worker_takes(name: str, value: float) -> bool:
    return step_problem(common_pb2.SamplingParams(**{name: value}), VOCAB) is None


@pytest.mark.parametrize("allowed", SCALARS, ids=lambda r: r.name)
def test_every_layer_takes_exactly_the_values_of_the_one_range(allowed: Range) -> None:
    for value in PROBES:
        held = f32(value)  # what the scheduler and the worker receive
        expected = allowed.contains(held)
        got = {
            "gateway": gateway_takes(allowed.name, value),
            "scheduler": scheduler_takes(allowed.name, value),
            "worker": worker_takes(allowed.name, value),
        }
        assert got == dict.fromkeys(got, expected), (allowed.name, value)


def test_top_p_is_refused_at_zero_by_the_scheduler_and_the_gateway_alike() -> None:
    """The two used to disagree: (0, 1] in the scheduler, [0, 1] in the worker."""
    assert not gateway_takes("top_p", 0.0) and not scheduler_takes("top_p", 0.0)
    # the worker's message is the request's (common.SamplingParams): unset is not 0 there
    assert not worker_takes("top_p", 0.0)
    assert not worker_takes("top_p", 1.5) and not worker_takes("top_p", -0.5)


def test_a_repetition_penalty_that_overflows_the_logits_is_refused_everywhere() -> None:
    for tiny in (1e-38, 1e-9):
        assert not gateway_takes("repetition_penalty", tiny)
        assert not scheduler_takes("repetition_penalty", tiny)
        assert not worker_takes("repetition_penalty", tiny)
    for usual in (0.5, 1.0, 1.3, 1000.0):
        assert gateway_takes("repetition_penalty", usual) and worker_takes(
            "repetition_penalty", usual
        )


def test_logit_bias_values_are_bounded_by_every_layer() -> None:
    for bias, ok in ((100.0, True), (-100.0, True), (100.5, False), (math.inf, False)):
        assert LOGIT_BIAS.contains(bias) is ok
        params = common_pb2.SamplingParams(max_tokens=8, logit_bias={3: bias})
        assert gateway_takes("logit_bias", {3: bias}, max_tokens=8) is ok
        assert (submit_problem([1], [], params, VOCAB) is None) is ok
        assert (step_problem(common_pb2.SamplingParams(logit_bias={3: bias}), VOCAB) is None) is ok


def test_a_refusal_names_the_field_the_range_and_what_it_means() -> None:
    assert TOP_P.refusal(0.0) == "top_p is 0.0; it must be in (0, 1] (1 disables it)"
    assert TEMPERATURE.refusal(-1) == (
        "temperature is -1; it must be a finite number >= 0 (0 means greedy decoding)"
    )
    assert PRESENCE_PENALTY.problem(2.0) is None
    assert PRESENCE_PENALTY.problem(3) == "presence_penalty is 3; it must be in [-2, 2]"
    assert not TOP_P.contains(True) and not TOP_P.contains("0.5")


@pytest.mark.parametrize("kind", [0, 5, 99])
def test_a_grammar_kind_no_worker_compiles_is_refused_at_the_schedulers_door(kind) -> None:
    """A direct Submit (a peer, not the gateway) with grammar kind 0 or 99 had been taken and
    failed at the worker as the request's run (internal-services sweep M4)."""
    sampling = common_pb2.SamplingParams(max_tokens=4)
    sampling.grammar.kind = kind  # type: ignore[assignment]
    sampling.grammar.spec = "[a-z]+"
    problem = submit_problem([1, 2], [], sampling, 100)
    assert problem == f"grammar kind {kind} is not one of JSON_SCHEMA, REGEX, CHOICE, LARK"
    sampling.grammar.kind = common_pb2.Grammar.REGEX
    assert submit_problem([1, 2], [], sampling, 100) is None
