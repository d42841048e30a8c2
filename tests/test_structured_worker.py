"""Structured output on the worker: a constrained request's every token is one its grammar
allows (the tiny model's random weights alone would write noise), beside unconstrained requests
in the same batch, with seeds, penalties and logit_bias, and after a recompute (its matcher
rebuilt from the tokens it generated)."""

from __future__ import annotations

import json
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from gateway.tokenizer import load_default_tokenizer
from llmcommon.v1 import common_pb2, worker_pb2
from tests.model_support import model, one_torch_thread  # noqa: F401  (autouse fixture)
from worker_svc.grammar import GrammarCache, TokenTable, model_tokenizer, spec_of
from worker_svc.runner import ModelRunner
from worker_svc.session import Session

BLOCKS, BS = 256, 16  # 4096 positions
EOS = 2
PER_REQUEST = 24  # blocks each request is granted (384 positions)


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no other keys (as OpenAI's strict schemas)
    city: str = Field(max_length=12)
    zip_code: int = Field(ge=0, le=99999)


class Person(BaseModel):
    """Nested object, enum, array and optional field; strings and arrays bounded, so that a
    random model reaches the end within max_tokens."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=16)
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)
    nickname: str | None = Field(default=None, max_length=8)


SCHEMA = Person.model_json_schema()


@pytest.fixture(scope="module")
def grammars() -> GrammarCache:
    cache = GrammarCache(TokenTable(lambda: model_tokenizer("tiny", 49152, (EOS,))))
    cache.table.get()
    return cache


def tiny_session(grammars: GrammarCache | None) -> Session:
    config, weights = model("tiny")
    runner = ModelRunner(config, weights, num_blocks=BLOCKS, block_size=BS, dtype=torch.float32)
    return Session(runner, BLOCKS, grammars)


def constrained(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        **{"temperature": 0.0, **kw}, grammar=spec_of("json_schema", SCHEMA)
    )


def add(step, handle: int, tokens: list[int], sampling, sample_index: int = 0) -> None:
    step.added.add(
        handle=handle, request_id=f"r{handle}", sampling=sampling, sample_index=sample_index
    )
    first = handle * PER_REQUEST
    step.grants.add(handle=handle, blocks=range(first, first + PER_REQUEST))
    step.chunks.add(handle=handle, token_ids=tokens, start_position=0, sample=True)


def generate(session: Session, requests: dict[int, tuple], limit: int = 300) -> dict[int, list]:
    """Run the requests (handle -> (prompt, sampling)) added in one step until each samples
    EOS or `limit` tokens: what each generated, EOS left out."""
    first = worker_pb2.Step(step=1)
    for handle, (prompt, sampling) in requests.items():
        add(first, handle, prompt, sampling)
    return run_on(session, first, list(requests), {h: [] for h in requests}, limit)


def run_on(session: Session, step, handles: list[int], out: dict[int, list], limit: int):
    number = step.step
    live = list(handles)
    while live:
        result, _, _ = session.run(step)
        assert not result.failed and not result.error, (result.failed, result.error)
        for handle, token in zip(live, result.tokens, strict=True):
            if token != EOS:
                out[handle].append(token)
        live = [h for h, t in zip(live, result.tokens, strict=True) if t != EOS]
        live = [h for h in live if len(out[h]) < limit]
        number += 1
        step = worker_pb2.Step(step=number, decodes=live)
        # a chunk's handles come before the decodes in a result: keep that order for zip
    return out


def text_of(tokens: list[int]) -> str:
    return load_default_tokenizer().decode(tokens)


PROMPT = load_default_tokenizer().encode("Give me a person as JSON:")


def test_every_constrained_answer_validates_beside_unconstrained_rows(grammars) -> None:
    """Eight seeded draws at temperature 1 under the schema, each with its own penalties and
    biases, and two unconstrained rows in the same batch."""
    session = tiny_session(grammars)
    requests = {
        h: (
            PROMPT,
            constrained(
                temperature=1.0,
                seed=h,
                presence_penalty=0.5 * (h % 3),
                repetition_penalty=1.0 + 0.1 * (h % 2),
                logit_bias={90: 5.0} if h % 4 == 0 else {},
            ),
        )
        for h in range(8)
    }
    free = common_pb2.SamplingParams(temperature=0.0)
    requests[8] = (PROMPT, free)
    requests[9] = (PROMPT, common_pb2.SamplingParams(temperature=1.0, seed=9))
    out = generate(session, requests, limit=300)
    for h in range(8):
        person = Person.model_validate_json(text_of(out[h]))  # raises if it is not valid
        assert person.role in ("admin", "user", "guest")
    # the unconstrained rows are what they are alone: the mask touched only the constrained
    alone = generate(tiny_session(grammars), {8: (PROMPT, free)}, limit=len(out[8]))
    assert out[8] == alone[8]
    with pytest.raises(ValueError):
        json.loads(text_of(out[8]))


def test_a_recomputed_request_continues_its_answer_from_the_tokens_it_generated(grammars):
    """Stopped after 12 tokens and placed again (its prompt and those tokens as one chunk, as
    the scheduler sends a preempted request), it writes the same answer as without the stop."""
    sampling = constrained(temperature=1.0, seed=7)
    whole = generate(tiny_session(grammars), {0: (PROMPT, sampling)})[0]
    session = tiny_session(grammars)
    first = generate(session, {0: (PROMPT, sampling)}, limit=12)[0]
    assert first == whole[:12]
    again = worker_pb2.Step(step=100, released=[0])
    add(again, 1, PROMPT + first, sampling, sample_index=len(first))
    rest = run_on(session, again, [1], {1: []}, 300)[1]
    assert first + rest == whole
    Person.model_validate_json(text_of(whole))


def test_regex_choice_and_lark_grammars_hold(grammars) -> None:
    session = tiny_session(grammars)
    grammars_asked = {
        0: spec_of("regex", r"[0-9]{3}-[a-z]{2,4}"),
        1: spec_of("choice", ["yes", "no", "maybe"]),
        2: spec_of("lark", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'),
    }
    requests = {
        h: (PROMPT, common_pb2.SamplingParams(temperature=1.0, seed=h, grammar=g))
        for h, g in grammars_asked.items()
    }
    out = generate(session, requests, limit=200)
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text_of(out[0]))
    assert text_of(out[1]) in ("yes", "no", "maybe")
    assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text_of(out[2]))


def test_a_grammar_that_does_not_compile_fails_its_request_alone(grammars) -> None:
    session = tiny_session(grammars)
    step = worker_pb2.Step(step=1)
    add(
        step,
        0,
        PROMPT,
        common_pb2.SamplingParams(temperature=0.0, grammar=spec_of("regex", "(unclosed")),
    )
    add(step, 1, PROMPT, common_pb2.SamplingParams(temperature=0.0))
    result, _, _ = session.run(step)
    assert list(result.failed) == [0]
    assert len(result.tokens) == 1


def test_without_a_grammar_cache_a_constrained_request_is_refused() -> None:
    session = tiny_session(None)
    step = worker_pb2.Step(step=1)
    add(step, 0, PROMPT, constrained())
    result, _, _ = session.run(step)
    assert "structured output" in result.failed[0]
