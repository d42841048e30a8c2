"""One sampling type end to end (llmcommon/sampling.py): every field walks from a gRPC
request through the gateway's validation, the wire, the scheduler and the worker's session, and
back; each check refuses what its range refuses, naming the field; unset is the default."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from types import MappingProxyType
from typing import Any

import pytest

from gateway.openai_requests import CompletionRequest
from gateway.service import generate_input
from gateway.validation import InvalidRequest, validate
from llmcommon.sampling import (
    CHECKS,
    GREEDY,
    MIN_TEMPERATURE,
    Grammar,
    InvalidSampling,
    SamplingParams,
    f32,
)
from llmcommon.sampling_wire import from_wire, params_of, to_wire
from llmcommon.v1 import common_pb2, gateway_pb2, scheduler_pb2, worker_pb2
from scheduler_svc.service import work_sampling
from scheduler_svc.submit_checks import submission_of
from worker_svc.session import Session
from worker_svc.sim import SimRunner, sim_config

# every field, none at its default, each exact in float32 (the wire's floats)
SENT: dict[str, Any] = dict(
    max_tokens=7,
    temperature=0.5,
    top_p=0.75,
    top_k=3,
    seed=2**64 - 1,
    stop=("END",),
    ignore_eos=True,
    min_p=0.25,
    presence_penalty=-1.5,
    frequency_penalty=1.25,
    repetition_penalty=2.0,
    stop_token_ids=(5, 9),
    min_tokens=2,
    logit_bias={3: -2.5},
    logprobs=4,
    grammar=Grammar(kind=common_pb2.Grammar.REGEX, spec="[a-z]+"),
)
EOS = 2


class RecordingGrammars:
    """Stands for the worker's GrammarCache: records the grammar it is asked to compile."""

    def __init__(self) -> None:
        self.asked: list[object] = []

    def state(self, grammar: object, vocab_size: int) -> object:
        self.asked.append(grammar)
        return object()


def wire_request() -> gateway_pb2.GenerateRequest:
    """The request as a gRPC client writes it, field by field (not with to_wire)."""
    grammar = common_pb2.Grammar(kind=SENT["grammar"].kind, spec=SENT["grammar"].spec)
    return gateway_pb2.GenerateRequest(
        prompt="hi", sampling=common_pb2.SamplingParams(**(SENT | {"grammar": grammar}))
    )


def scheduler_takes(submitted: common_pb2.SamplingParams) -> SamplingParams:
    """The settings as the scheduler's door converts them."""
    submit = scheduler_pb2.SubmitRequest(prompt_token_ids=[1], sampling=submitted)
    return submission_of(submit, 0).sampling


def scheduler_forwards(submitted: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
    """What the scheduler's Submit hands the worker: every id that ends the request."""
    params = scheduler_takes(submitted)
    return to_wire(work_sampling(params, {EOS, *params.stop_token_ids}))


def worker_receives(message: common_pb2.SamplingParams) -> tuple[SamplingParams, list[object]]:
    grammars = RecordingGrammars()
    session = Session(SimRunner(sim_config(64), 4, 16, 0.0), 4, grammars)  # type: ignore[arg-type]
    step = worker_pb2.Step(step=0)
    step.added.add(handle=1, request_id="r", sampling=message)
    failed: dict[int, str] = {}
    session.apply(step, failed)
    assert not failed
    item = session.items[1]
    assert item.grammar is not None  # the worker-only state beside the params
    return item.sampling, grammars.asked


def test_the_walk_sets_every_field_off_its_default() -> None:
    default = SamplingParams()
    assert set(SENT) == {f.name for f in fields(SamplingParams)}
    assert all(SENT[name] != getattr(default, name) for name in SENT)
    assert all(f32(v) == v for v in SENT.values() if isinstance(v, float))


def test_every_field_walks_from_the_gateway_to_the_worker_and_back() -> None:
    job = generate_input(wire_request())
    validated = validate(job.prompt, None, job.sampling, max_context=64, default_max_tokens=8)
    assert validated.sampling == SamplingParams(**SENT)
    submitted = to_wire(validated.sampling)  # the gateway's Submit
    assert submitted == wire_request().sampling
    forwarded = scheduler_forwards(submitted)
    got, compiled = worker_receives(forwarded)
    ends = tuple(sorted({EOS, *SENT["stop_token_ids"]}))
    assert got == SamplingParams(**SENT | {"stop": (), "stop_token_ids": ends})
    assert compiled == [SENT["grammar"]]
    assert to_wire(got) == forwarded  # and back


def test_the_settings_as_sent_hold_plain_values_not_the_messages_containers() -> None:
    sent = params_of(wire_request().sampling)
    assert sent == SamplingParams(**SENT)
    assert type(sent.logit_bias) is dict
    assert type(sent.stop) is tuple and type(sent.stop_token_ids) is tuple
    assert type(sent.grammar) is Grammar


def test_every_field_has_one_check() -> None:
    assert list(CHECKS) == [f.name for f in fields(SamplingParams)]


def test_unset_fields_are_the_defaults_on_every_hop() -> None:
    unset = common_pb2.SamplingParams()
    assert params_of(unset) == SamplingParams()
    assert to_wire(SamplingParams()) == common_pb2.SamplingParams(
        temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0
    )  # None is unset; the rest is sent as it is
    sent = common_pb2.SamplingParams(max_tokens=3, stop=["x"])
    forwarded = to_wire(work_sampling(scheduler_takes(sent), ()))
    assert from_wire(forwarded) == SamplingParams(max_tokens=3)  # no stop strings sent on


def problem(**sent: Any) -> tuple[str, str] | None:
    invalid = SamplingParams(**sent).problem()
    return None if invalid is None else (invalid.param, str(invalid))


@pytest.mark.parametrize(
    ("sent", "param", "message"),
    [
        ({"max_tokens": 0}, "max_tokens", "max_tokens is 0; it must be at least 1"),
        ({"max_tokens": "8"}, "max_tokens", "max_tokens must be an integer, not str"),
        ({"top_k": -1}, "top_k", "top_k is -1; it must be >= 0 (0 disables it)"),
        ({"top_k": True}, "top_k", "top_k must be an integer, not bool"),
        ({"seed": -1}, "seed", "seed is -1; it must be an integer in [0, 2**64 - 1]"),
        ({"seed": 2**64}, "seed", f"seed is {2**64}; it must be an integer in [0, 2**64 - 1]"),
        ({"seed": 1.0}, "seed", "seed is 1.0; it must be an integer in [0, 2**64 - 1]"),
        ({"seed": True}, "seed", "seed is True; it must be an integer in [0, 2**64 - 1]"),
        ({"stop": "x"}, "stop", "stop must be a list of strings"),
        ({"ignore_eos": 1}, "ignore_eos", "ignore_eos must be true or false"),
        ({"min_p": 1.5}, "min_p", "min_p is 1.5; it must be in [0, 1] (0 disables it)"),
        (
            {"presence_penalty": 2.5},
            "presence_penalty",
            "presence_penalty is 2.5; it must be in [-2, 2]",
        ),
        (
            {"frequency_penalty": -3},
            "frequency_penalty",
            "frequency_penalty is -3; it must be in [-2, 2]",
        ),
        (
            {"repetition_penalty": 1e-4},  # below 1e-4 as the wire holds it (float32)
            "repetition_penalty",
            "repetition_penalty is 0.0001; it must be in [0.0001, 10000] (1 disables it);"
            " the wire's float32 holds 0.0001 as 9.999999747378752e-05",
        ),
        (
            {"top_p": 1e-300},  # in (0, 1] as sent, 0 as the wire holds it
            "top_p",
            "top_p is 1e-300; it must be in (0, 1] (1 disables it);"
            " the wire's float32 holds 1e-300 as 0.0",
        ),
        (
            {"stop_token_ids": (3, -1)},
            "stop_token_ids",
            "stop_token_ids holds an id that is not a token id (0 or more)",
        ),
        (
            {"stop_token_ids": (3, True)},
            "stop_token_ids",
            "stop_token_ids holds an id that is not a token id (0 or more)",
        ),
        ({"min_tokens": -1}, "min_tokens", "min_tokens is -1; it must be an integer >= 0"),
        ({"min_tokens": 1.0}, "min_tokens", "min_tokens is 1.0; it must be an integer >= 0"),
        (
            {"max_tokens": 3, "min_tokens": 4},
            "min_tokens",
            "min_tokens 4 is more than max_tokens 3",
        ),
        (
            {"logit_bias": {1: 0.0, 2: 101.0}},
            "logit_bias",
            "logit_bias values must be in [-100, 100]",
        ),
        ({"logprobs": 21}, "logprobs", "logprobs (top alternatives) must be at most 20, got 21"),
        ({"logprobs": -1}, "logprobs", "logprobs (top alternatives) must be at most 20, got -1"),
        (
            {"logprobs": True},
            "logprobs",
            "logprobs (top alternatives) must be at most 20, got True",
        ),
    ],
)
def test_a_setting_out_of_its_range_is_refused_naming_it(sent, param, message) -> None:
    assert problem(**sent) == (param, message)
    with pytest.raises(InvalidSampling) as err:
        SamplingParams(**sent).checked()
    assert err.value.param == param


@pytest.mark.parametrize(
    "sent",
    [
        {"max_tokens": 1},
        {"max_tokens": None},
        {"top_k": 0},
        {"seed": 0},
        {"seed": 2**64 - 1},
        {"stop": ["a"] * 16},
        {"ignore_eos": False},
        {"stop_token_ids": (0,)},
        {"min_tokens": 0},
        {"max_tokens": 4, "min_tokens": 4},
        {"min_tokens": 9},  # max_tokens unset: checked once the gateway resolves it
        {"logit_bias": {1: -100.0, 2: 100.0}},
        {"logprobs": 0},
        {"logprobs": 20},
        {"repetition_penalty": 1.0001e-4},
        {"grammar": Grammar(kind=1, spec="{}")},
    ],
)
def test_the_edges_of_each_range_are_taken(sent) -> None:
    assert problem(**sent) is None


def test_a_float_is_checked_as_the_wire_holds_it() -> None:
    assert f32(1e39) == math.inf and f32(-1e39) == -math.inf
    assert f32(0.1) != 0.1 and f32(0.5) == 0.5
    assert f32("x") == "x" and f32(True) is True
    assert problem(temperature=1e39) == (
        "temperature",
        "temperature is 1e+39; it must be a finite number >= 0 (0 means greedy decoding);"
        " the wire's float32 holds 1e+39 as inf",
    )
    assert problem(logit_bias={1: 1e39}) is not None
    assert problem(logit_bias={1: 100.000001}) is None  # 100 as the wire holds it


def test_checked_settings_are_canonical() -> None:
    sent = SamplingParams(
        temperature=MIN_TEMPERATURE / 2,
        stop=["a"],
        stop_token_ids=[4],
        logit_bias=MappingProxyType({1: 2.0}),
    )
    got = sent.checked()
    assert got.temperature == 0.0 and got.greedy
    assert got.stop == ("a",) and got.stop_token_ids == (4,)
    assert type(got.logit_bias) is dict and got.logit_bias == {1: 2.0}
    assert SamplingParams(temperature=2).checked().temperature == 2.0
    assert type(SamplingParams(temperature=2).checked().temperature) is float
    assert SamplingParams(temperature=MIN_TEMPERATURE).checked().temperature == MIN_TEMPERATURE


def test_the_wire_refusal_names_the_field() -> None:
    with pytest.raises(InvalidSampling) as err:
        from_wire(common_pb2.SamplingParams(top_p=0.0))
    assert err.value.param == "top_p"
    with pytest.raises(InvalidRequest) as refused:  # the gateway's, with the same name
        validate("hi", None, params_of(common_pb2.SamplingParams(top_p=0.0)), 64, 8)
    assert refused.value.param == "top_p"


@pytest.mark.parametrize(
    ("sent", "greedy", "penalized", "needs_history", "shapes_logits"),
    [
        ({}, False, False, False, False),
        ({"temperature": 0.0}, True, False, False, False),
        ({"top_k": 1}, True, False, False, False),
        ({"top_k": 2}, False, False, False, False),
        ({"presence_penalty": 0.5}, False, True, True, True),
        ({"frequency_penalty": -0.5}, False, True, True, True),
        ({"repetition_penalty": 1.1}, False, True, True, True),
        ({"grammar": Grammar(1, "{}")}, False, False, True, True),
        ({"logit_bias": {1: 1.0}}, False, False, False, True),
        ({"min_tokens": 2, "stop_token_ids": (2,)}, False, False, False, True),
        ({"min_tokens": 1, "stop_token_ids": (2,)}, False, False, False, True),
        ({"min_tokens": 2}, False, False, False, False),
        ({"stop_token_ids": (2,)}, False, False, False, False),
    ],
)
def test_what_the_sampler_derives(sent, greedy, penalized, needs_history, shapes_logits) -> None:
    s = SamplingParams(**sent)
    assert (s.greedy, s.penalized, s.needs_history, s.shapes_logits) == (
        greedy,
        penalized,
        needs_history,
        shapes_logits,
    )


def test_a_work_item_samples_greedily_by_default() -> None:
    assert GREEDY.greedy and GREEDY == SamplingParams(temperature=0.0)


def test_a_token_id_outside_the_vocabulary_is_named_with_it() -> None:
    assert SamplingParams(logit_bias={9: 1.0}, stop_token_ids=(3,)).vocab_problem(10) is None
    assert SamplingParams(stop_token_ids=(3, 10)).vocab_problem(10) == (
        "token id 10 in stop_token_ids is outside the vocabulary of 10 tokens (0 to 9)"
    )
    both = SamplingParams(logit_bias={12: 1.0, 5: 1.0}, stop_token_ids=(11,))
    assert both.vocab_problem(10) == (
        "token id 12 in logit_bias is outside the vocabulary of 10 tokens (0 to 9)"
    )
    assert SamplingParams().vocab_problem(1) is None


def test_every_field_has_its_name_in_the_openai_body() -> None:
    """The HTTP API's one mapping (Sampling.params): a field the body cannot set fails this."""
    body = {
        "prompt": "hi",
        **{k: v for k, v in SENT.items() if k not in ("stop", "logit_bias", "grammar")},
        "stop": list(SENT["stop"]),
        "stop_token_ids": list(SENT["stop_token_ids"]),
        "logit_bias": {str(k): v for k, v in SENT["logit_bias"].items()},
        "guided_regex": SENT["grammar"].spec,
    }
    sent = CompletionRequest.parse(json.dumps(body).encode()).generate_input().sampling
    assert sent.checked() == SamplingParams(**SENT)
