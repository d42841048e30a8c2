"""Tools through real processes (the tiny model's random weights: with tool_choice required or
a named function, the grammar alone makes each call valid), with the real `openai` SDK
(whole and streamed), LangChain's `bind_tools` and `with_structured_output(...,
method="function_calling")`; auto's prompt and answer; malformed tools are 400 naming the field."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.stacks import running_stack, tiny_settings, with_http_port

pytestmark = pytest.mark.usefixtures("hang_guard")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
ADD_PARAMS = {
    "type": "object",
    "properties": {  # bounded: a random model closes a number only when it must
        "a": {"type": "integer", "minimum": -999, "maximum": 999},
        "b": {"type": "integer", "minimum": -999, "maximum": 999},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "add", "parameters": ADD_PARAMS}},
]
PARAMS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}
BAD = {"type": "object", "properties": {"a": {"type": "nonsense"}}}  # not a schema llguidance takes


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Weather(Strict):
    """The weather to look up."""

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings = with_http_port(tiny_settings(max_running=8, default_max_tokens=200))
    with running_stack(settings, tmp_path_factory.mktemp("tools")) as s:
        yield s


@pytest.fixture(scope="module")
def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.settings.http_url, api_key="-", max_retries=0, timeout=120)


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), PARAMS[name])


def test_required_and_named_calls_are_valid_20_of_20_each(sdk) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, seed in (("required", 0), (named, 1)):
        reply = sdk.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            n=10,
            seed=seed,
            temperature=1.0,
            max_tokens=200,
        )
        reply2 = sdk.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            n=10,
            seed=seed + 10,
            temperature=1.0,
            max_tokens=200,
        )
        choices = reply.choices + reply2.choices
        assert len(choices) == 20
        for c in choices:
            assert c.finish_reason == "tool_calls", c.message.content
            assert c.message.content is None
            (call,) = c.message.tool_calls
            assert call.id.startswith("call_") and call.type == "function"
            if choice == named:
                assert call.function.name == "get_weather"
            _valid(call.function.name, call.function.arguments)


def test_streamed_calls_come_as_openai_streams_them(sdk) -> None:
    for seed in range(3):
        stream = sdk.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            seed=seed,
            temperature=1.0,
            max_tokens=200,
            stream=True,
        )
        chunks = [c for c in stream if c.choices]
        deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
        head = deltas[0][0]
        assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
        assert head.function.arguments == "" and head.function.name in PARAMS
        rest = [d[0] for d in deltas[1:]]
        assert len(rest) > 1  # the arguments in fragments, as they come
        assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
        _valid(head.function.name, "".join(d.function.arguments for d in rest))
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not any(c.choices[0].delta.content for c in chunks)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_streamed_calls_logprobs_are_every_tokens_as_not_streamed(sdk, choice) -> None:
    """One logprobs entry per token, streamed or not: those of the tokens the tool stream
    holds back (the call's head, its closing brace, the end) go with a later chunk. (They were
    dropped: 33 of 45 streamed.)"""
    ask = dict(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
        seed=3, temperature=1.0, max_tokens=200, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    whole = sdk.chat.completions.create(**ask)
    expected = [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    assert len(expected) == whole.usage.completion_tokens
    chunks = [c for c in sdk.chat.completions.create(**ask, stream=True) if c.choices]
    streamed = [
        (e.token, e.logprob)
        for c in chunks
        if c.choices[0].logprobs is not None
        for e in c.choices[0].logprobs.content
    ]
    assert streamed == expected
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_parallel_calls_are_one_or_more_valid_calls_whole_and_streamed(sdk) -> None:
    asked = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400)
    reply = sdk.chat.completions.create(**asked, n=10, seed=3, temperature=1.0)
    counts = []
    for choice in reply.choices:
        calls = choice.message.tool_calls or []
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.content is None
        assert calls or choice.finish_reason == "length"
        assert len({c.id for c in calls}) == len(calls)
        for call in calls:
            _valid(call.function.name, call.function.arguments)
        counts.append(len(calls))
    assert max(counts) > 1  # several calls in one answer
    for seed in range(4):
        stream = sdk.chat.completions.create(**asked, seed=seed, temperature=1.0, stream=True)
        streamed: dict[int, list] = {}
        for chunk in stream:
            for part in (chunk.choices and chunk.choices[0].delta.tool_calls) or []:
                if part.id is not None:
                    assert part.index == len(streamed) and part.function.arguments == ""
                    streamed[part.index] = [part.function.name, ""]
                else:
                    streamed[part.index][1] += part.function.arguments
        assert streamed
        if chunk.choices[0].finish_reason == "tool_calls":  # every call ended
            for name, arguments in streamed.values():
                _valid(name, arguments)


def test_auto_describes_the_tools_and_answers_text_or_calls(stack, sdk) -> None:
    import httpx

    url = stack.settings.http_url.removesuffix("/v1")
    described = httpx.post(f"{url}/tokenize", json={"messages": ASK}).json()["count"]
    reply = sdk.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, seed=0, temperature=1.0, max_tokens=30
    )
    # the tools' description is in the prompt: it is longer than the bare messages
    assert reply.usage.prompt_tokens > described + 50
    choice = reply.choices[0]
    # a random model writes no call: a normal answer (the parser is pinned by test_tools_parse)
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    none = sdk.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", seed=0, max_tokens=5
    )
    assert none.usage.prompt_tokens == described  # none: the tools are not described
    # forced, the model sees what it must call as well (OpenAI's and vLLM's do): all the tools
    # for required, the named one alone for a named choice
    required = sdk.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", seed=0, max_tokens=5
    )
    assert required.usage.prompt_tokens == reply.usage.prompt_tokens
    name = TOOLS[1]["function"]["name"]
    named = sdk.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": name}},
        seed=0,
        max_tokens=5,
    )
    assert described + 20 < named.usage.prompt_tokens < reply.usage.prompt_tokens


def test_malformed_tools_are_a_400_naming_the_field(sdk) -> None:
    cases = [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        (
            {
                "tools": [
                    TOOLS[0],
                    {"type": "function", "function": {"name": "f", "parameters": BAD}},
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
        ),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, extra_body=extra)
        assert caught.value.body["param"] == param, caught.value.body


def test_langchain_bind_tools_and_function_calling(stack) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=stack.settings.http_url,
        api_key="-",
        model="tiny",
        temperature=1.0,
        max_tokens=200,
        seed=5,
        max_retries=0,
    )
    message = llm.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Oslo?")
    (call,) = message.tool_calls
    assert call["name"] == "Weather" and call["id"].startswith("call_")
    Weather.model_validate(call["args"])
    weather = llm.with_structured_output(Weather, method="function_calling").invoke("Oslo?")
    assert isinstance(weather, Weather)


def test_an_auto_answer_holding_a_call_is_parsed_whole_and_streamed(sdk) -> None:
    """The model's answer made a Hermes call by a choice grammar: auto parses it; streamed, the
    call comes once its block closed (its head, then its arguments as written), the same
    arguments as the whole answer's."""
    written = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    asked = dict(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=100,
        extra_body={"structured_outputs": {"choice": [written]}},
    )
    choice = sdk.chat.completions.create(**asked).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    chunks = [c for c in sdk.chat.completions.create(**asked, stream=True) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert content == "Sure." and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls[0].id.startswith("call_") and calls[0].function.name == "add"
    assert calls[0].function.arguments == "" and all(c.index == 0 for c in calls)
    assert "".join(c.function.arguments for c in calls[1:]) == call.function.arguments


def test_an_auto_block_of_broken_json_is_text_whole_and_streamed(sdk) -> None:
    """The sweep's F3 through real processes: a block whose brackets balance but whose JSON is
    broken was streamed as a call (finish tool_calls, arguments that do not parse) while the
    answer not streamed was text; both are text now, finish stop."""
    written = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": }\n</tool_call>'
    asked = dict(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        max_tokens=100,
        extra_body={"structured_outputs": {"choice": [written]}},
    )
    choice = sdk.chat.completions.create(**asked).choices[0]
    assert (choice.finish_reason, choice.message.content) == ("stop", written)
    assert choice.message.tool_calls is None
    chunks = [c for c in sdk.chat.completions.create(**asked, stream=True) if c.choices]
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == written
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_forced_call_cut_by_max_tokens_is_the_same_call_whole_and_streamed(sdk) -> None:
    """The sweep's F1 through real processes: cut inside its arguments, the answer not streamed
    held the grammar's JSON as content and no call; now both hold the call as far as it came,
    finish length, content null."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    asked = dict(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice=named,
        max_tokens=16,  # past the call's head, short of its arguments' end
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = sdk.chat.completions.create(**asked).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    chunks = [c for c in sdk.chat.completions.create(**asked, stream=True) if c.choices]
    assert chunks[0].choices[0].delta.content is None  # F8: no "" for a forced call
    parts = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert parts[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"


def test_langchain_streams_a_bound_tools_call(stack) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=stack.settings.http_url,
        api_key="-",
        model="tiny",
        temperature=1.0,
        max_tokens=200,
        seed=6,
        max_retries=0,
    )
    bound = llm.bind_tools([Weather], tool_choice="Weather", parallel_tool_calls=False)
    chunks = list(bound.stream("Weather in Oslo?"))
    assert sum(bool(c.tool_call_chunks) for c in chunks) > 2  # the arguments in fragments
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    (call,) = whole.tool_calls
    assert call["name"] == "Weather" and call["id"].startswith("call_")
    Weather.model_validate(call["args"])
