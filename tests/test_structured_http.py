"""Structured output through real processes (the tiny model's random weights: the grammar alone
makes each answer valid), with the real `openai` SDK's `parse`, LangChain's
`with_structured_output`, raw vLLM fields, and the gRPC API; invalid grammars are 400 naming
the field; a constrained request recomputed after preemptions (a small KV pool) stays valid."""

from __future__ import annotations

import json
import re
import threading
from typing import Literal

import grpc
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from llmcommon.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.stacks import running_stack, tiny_settings, with_http_port

pytestmark = pytest.mark.usefixtures("hang_guard")
ASK = [{"role": "user", "content": "Describe a person."}]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict asks


class Address(Strict):
    city: str = Field(max_length=12)
    zip_code: int = Field(ge=0, le=99999)


class Person(Strict):
    """Nested object, enum, array, optional field; bounded strings and arrays (a random model
    closes them only when it must)."""

    name: str = Field(max_length=16)
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)
    nickname: str | None = Field(default=None, max_length=8)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings = with_http_port(tiny_settings(max_running=8, default_max_tokens=400))
    with running_stack(settings, tmp_path_factory.mktemp("so")) as s:
        yield s


@pytest.fixture(scope="module")
def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.settings.http_url, api_key="-", max_retries=0, timeout=120)


def test_every_parsed_answer_validates_50_of_50(stack, sdk) -> None:
    """The SDK sends the model's strict JSON schema; 5 calls of n=10 seeded draws."""
    parsed = []
    for call in range(5):
        reply = sdk.chat.completions.parse(
            model="tiny",
            messages=ASK,
            response_format=Person,
            n=10,
            seed=call,
            temperature=1.0,
            max_tokens=400,
        )
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice.message.content
            parsed.append(choice.message.parsed)
    assert len(parsed) == 50 and all(isinstance(p, Person) for p in parsed)


def test_json_object_mode_and_streaming_give_a_json_object(sdk) -> None:
    reply = sdk.chat.completions.create(
        model="tiny",
        messages=ASK,
        response_format={"type": "json_object"},
        temperature=1.0,
        seed=3,
        max_tokens=400,
        extra_body={"presence_penalty": 0.5},
    )
    # any JSON object: a random model may write long strings, so only check the object shape
    # when it finished; it must at least start as an object
    text = reply.choices[0].message.content
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    stream = sdk.chat.completions.create(
        model="tiny",
        messages=ASK,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": Person.model_json_schema(), "strict": True},
        },
        temperature=1.0,
        seed=4,
        max_tokens=400,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    Person.model_validate_json(streamed)


def test_vllm_structured_outputs_on_completions(sdk) -> None:
    cases = {
        "regex": (r"[0-9]{3}-[a-z]{2,4}", lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        "choice": (["red", "green", "blue"], lambda t: t in ("red", "green", "blue")),
        "grammar": ('start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/', None),
    }
    for key, (spec, ok) in cases.items():
        for asked in ({"structured_outputs": {key: spec}}, {f"guided_{key}": spec}):
            reply = sdk.completions.create(
                model="tiny", prompt="Answer:", max_tokens=60, temperature=1.0, extra_body=asked
            )
            text = reply.choices[0].text
            check = ok or (lambda t: re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", t))
            assert check(text), (key, text)


def test_an_invalid_grammar_is_a_400_naming_its_field(sdk) -> None:
    bad = {
        "response_format.json_schema.schema": {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
        "response_format.type": {"response_format": {"type": "yaml"}},
        "structured_outputs.regex": {"structured_outputs": {"regex": "(unclosed"}},
        "guided_grammar": {"guided_grammar": "start: undefined_rule"},
        "structured_outputs.choice": {"structured_outputs": {"choice": "red"}},
    }
    for param, body in bad.items():
        with pytest.raises(openai.BadRequestError) as err:
            sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, extra_body=body)
        assert err.value.body["param"] == param, (param, err.value.body)


def test_the_grpc_api_takes_a_grammar_and_names_an_invalid_one(stack) -> None:
    channel = grpc.insecure_channel(stack.settings.gateway)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    grammar = common_pb2.Grammar(
        kind=common_pb2.Grammar.JSON_SCHEMA, spec=json.dumps(Person.model_json_schema())
    )
    sampling = common_pb2.SamplingParams(max_tokens=400, temperature=1.0, seed=5, grammar=grammar)
    result = stub.GenerateUnary(gateway_pb2.GenerateRequest(prompt="A person:", sampling=sampling))
    Person.model_validate_json(result.text)
    sampling.grammar.spec = '{"type": 12}'
    with pytest.raises(grpc.RpcError) as err:
        stub.GenerateUnary(gateway_pb2.GenerateRequest(prompt="A person:", sampling=sampling))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.grammar" in err.value.details()
    channel.close()


def test_constrained_and_free_requests_share_batches(stack, sdk) -> None:
    """Four of each at once (max_running 8): the constrained ones validate; the free ones run
    beside them as they would anyway (ignore_eos: exactly max_tokens)."""
    out: dict[int, str] = {}

    def one(i: int) -> None:
        if i % 2:
            reply = sdk.chat.completions.create(
                model="tiny",
                messages=ASK,
                max_tokens=30,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        else:
            reply = sdk.chat.completions.parse(
                model="tiny", messages=ASK, response_format=Person, temperature=1.0, seed=i
            )
        out[i] = reply.choices[0].message.content

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(out) == 8
    for i in range(0, 8, 2):
        Person.model_validate_json(out[i])


def test_a_constrained_request_recomputed_after_preemption_stays_valid(tmp_path) -> None:
    """A KV pool of 160 positions (10 blocks) for 6 constrained requests of ~30-60 tokens
    each: the scheduler preempts some (their KV freed, recomputed later, their matchers rebuilt
    from the tokens they had generated); every answer is still valid."""
    settings = tiny_settings(kv_capacity=160, max_running=6)
    schema = json.dumps(Person.model_json_schema())
    grammar = common_pb2.Grammar(kind=common_pb2.Grammar.JSON_SCHEMA, spec=schema)
    results: dict[int, gateway_pb2.GenerateResult] = {}
    with running_stack(settings, tmp_path):
        channel = grpc.insecure_channel(settings.gateway)
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def one(i: int) -> None:
            sampling = common_pb2.SamplingParams(
                max_tokens=120, temperature=1.0, seed=i, grammar=grammar
            )
            request = gateway_pb2.GenerateRequest(prompt=f"Person {i}:", sampling=sampling)
            results[i] = stub.GenerateUnary(request, timeout=300)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        channel.close()
    assert len(results) == 6
    assert sum(r.usage.preemptions for r in results.values()) > 0
    for result in results.values():
        Person.model_validate_json(result.text)


def test_langchain_with_structured_output_json_schema(stack) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=stack.settings.http_url,
        api_key="-",
        model="tiny",
        temperature=1.0,
        max_tokens=400,
        seed=11,
        max_retries=0,
    )
    person = llm.with_structured_output(Person, method="json_schema").invoke("A person, please.")
    assert isinstance(person, Person)


def test_langchain_with_structured_output_json_mode(stack) -> None:
    """json_mode asks for any JSON object (response_format json_object): the answer is one
    (a random model may write it past max_tokens: then the SDK refuses to parse it)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=stack.settings.http_url,
        api_key="-",
        model="tiny",
        temperature=1.0,
        max_tokens=400,
        seed=12,
        max_retries=0,
    )
    schema = {"title": "anything", "type": "object"}  # a dict: no Pydantic validation after
    runnable = llm.with_structured_output(schema, method="json_mode", include_raw=True)
    try:
        out = runnable.invoke("{}")
    except openai.LengthFinishReasonError as cut:  # the SDK's refusal of a cut answer
        assert cut.completion.choices[0].message.content.startswith("{")
    else:
        assert isinstance(out["parsed"], dict) and out["parsing_error"] is None


def test_a_seeded_constrained_answer_is_the_same_alone_and_in_a_batch(sdk) -> None:
    """Its narrow rows are drawn over their allowed ids with the generator of (seed, index):
    beside free and other constrained requests it is the same answer, token for token."""
    asked = dict(model="tiny", messages=ASK, response_format=Person, temperature=1.0, seed=21)
    alone = sdk.chat.completions.parse(**asked).choices[0].message.content
    out: dict[int, str] = {}

    def one(i: int) -> None:
        if i == 0:
            out[i] = sdk.chat.completions.parse(**asked).choices[0].message.content
        elif i % 2:
            sdk.chat.completions.create(
                model="tiny", messages=ASK, max_tokens=40, extra_body={"ignore_eos": True}
            )
        else:
            sdk.chat.completions.parse(**(asked | {"seed": 100 + i}))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out[0] == alone
    Person.model_validate_json(alone)
