"""Tools' pure logic (gateway/tools.py): tools and tool_choice read or refused naming the field,
the auto parser (tolerant; text without a call is an answer), a forced call's stream deltas."""

from __future__ import annotations

import json

import pytest

from gateway.tokenizer import hermes_system_prompt
from gateway.tools import ToolsProblem, forced_call, forced_calls, parse_calls, tool_plan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ADD = {"type": "function", "function": {"name": "add"}}
KNOWN = {"get_weather", "add"}


def test_auto_parser_finds_calls_and_keeps_the_rest_as_content() -> None:
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "parameters": "{\\"a\\": 1}"}'  # no closing tag, text args
    )
    content, calls = parse_calls(text, KNOWN)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


def test_auto_parser_leaves_text_without_a_valid_call_alone() -> None:
    for text in (
        "Just an answer.",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        '{"name": "add", "arguments": [1, 2]}',
    ):
        assert parse_calls(text, KNOWN) == (text, [])
    content, calls = parse_calls('  {"name": "add", "arguments": {"a": 2}} ', KNOWN)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": 2}


def test_forced_call_keeps_the_arguments_as_generated_and_refuses_a_cut_one() -> None:
    text = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    call = forced_call(text)
    assert call is not None
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert forced_call(text[:-3]) is None


def test_a_forced_stream_sends_the_head_then_argument_fragments() -> None:
    plan = tool_plan([WEATHER], "required")
    assert plan is not None and plan.forced
    stream = plan.stream()
    text = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i : i + 3])]
    deltas += stream.end()
    head = deltas[0]["tool_calls"][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]]
    assert len(fragments) > 1 and "".join(fragments) == '{"city": "Oslo"}'
    assert all(set(d["tool_calls"][0]) == {"index", "function"} for d in deltas[1:])
    assert stream.called


def test_tool_choice_none_auto_required_and_named() -> None:
    assert tool_plan(None, None) is None
    assert tool_plan([WEATHER], "none") is None
    auto = tool_plan([WEATHER, ADD], None)
    assert auto is not None and not auto.forced and auto.grammar() is None
    assert '"name": "get_weather"' in hermes_system_prompt(auto.described())
    named = tool_plan([WEATHER, ADD], {"type": "function", "function": {"name": "add"}})
    assert named is not None and [f.name for f in named.functions] == ["add"]
    schema = json.loads(named.grammar().spec)
    assert schema["properties"]["name"] == {"const": "add"}
    required = tool_plan([WEATHER, ADD], "required", parallel=False)
    assert len(json.loads(required.grammar().spec)["anyOf"]) == 2


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ({"type": "function"}, None, "tools"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function"}], None, "tools[0].function"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
        (
            [WEATHER, {"type": "function", "function": {"name": "x", "parameters": 3}}],
            None,
            "tools[1].function.parameters",
        ),
        ([WEATHER, WEATHER], None, "tools[1].function.name"),
        ([WEATHER], {"type": "function", "function": {"name": "add"}}, "tool_choice.function.name"),
        ([WEATHER], "always", "tool_choice"),
        (None, "required", "tool_choice"),
    ],
)
def test_malformed_tools_name_their_field(tools, choice, param) -> None:
    with pytest.raises(ToolsProblem) as caught:
        tool_plan(tools, choice)
    assert caught.value.param == param


def test_an_auto_stream_sends_content_as_it_comes_then_each_call_once_its_block_closed() -> None:
    plan = tool_plan([WEATHER, ADD], "auto")
    assert plan is not None
    stream = plan.stream()
    assert stream.feed("Sure") == [{"content": "Sure"}]
    assert stream.feed(". <tool") == [{"content": "."}]  # maybe a call's tag: held back
    assert stream.feed('_call>\n{"name": "add", ') == []  # the block has not closed
    assert stream.feed('"arguments": {"a": 1}}\n</tool') == []
    head, arguments = stream.feed("_call>")  # the call's brace and tag are not sent
    assert head["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert head["tool_calls"][0]["index"] == 0 and head["tool_calls"][0]["type"] == "function"
    assert arguments["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"a": 1}'}}
    assert stream.end() == [] and stream.called


def test_an_auto_stream_without_a_call_is_its_text() -> None:
    plan = tool_plan([WEATHER], "auto")
    assert plan is not None
    stream = plan.stream()
    pieces = ["Hello", " <b>", "old</b> ", "<tool", "s> end "]
    sent = [d["content"] for p in pieces for d in stream.feed(p)]
    assert sent and "".join(sent) != "".join(pieces)  # something was held back
    sent += [d["content"] for d in stream.end()]
    assert "".join(sent) == "".join(pieces) and not stream.called
    held = plan.stream()
    assert held.feed('{"name": "get_weather", "arguments": {"city": "Rome"}}') == []
    (head, arguments) = held.end()
    assert json.loads(arguments["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}


def test_required_with_parallel_calls_is_an_array_of_one_or_more_calls() -> None:
    for parallel in (None, True):
        plan = tool_plan([WEATHER, ADD], "required", parallel)
        schema = json.loads(plan.grammar().spec)
        assert schema["type"] == "array" and schema["minItems"] == 1
        assert len(schema["items"]["anyOf"]) == 2
    named = tool_plan([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, True)
    assert json.loads(named.grammar().spec)["properties"]["name"] == {"const": "add"}


TWO_CALLS = (
    '[{"name": "get_weather", "arguments": {"city": "Oslo \\"}{ ]"}}, '
    '{"name": "add", "arguments": {"a": [1, {"b": 2}]}}]'
)


def test_a_forced_array_streams_each_call_with_its_index() -> None:
    stream = tool_plan([WEATHER, ADD], "required").stream()
    deltas = [d for i in range(0, len(TWO_CALLS), 2) for d in stream.feed(TWO_CALLS[i : i + 2])]
    deltas += stream.end()
    calls: dict[int, dict] = {}
    for delta in deltas:
        (part,) = delta["tool_calls"]
        if "id" in part:
            calls[part["index"]] = {"name": part["function"]["name"], "arguments": ""}
        else:
            calls[part["index"]]["arguments"] += part["function"]["arguments"]
    assert [c["name"] for c in calls.values()] == ["get_weather", "add"]
    assert json.loads(calls[0]["arguments"]) == {"city": 'Oslo "}{ ]'}
    assert json.loads(calls[1]["arguments"]) == {"a": [1, {"b": 2}]}
    assert stream.called


def test_forced_calls_of_a_whole_answer_and_those_that_ended_before_a_cut() -> None:
    plan = tool_plan([WEATHER, ADD], "required")
    content, calls = plan.calls(TWO_CALLS)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert calls[1]["function"]["arguments"] == '{"a": [1, {"b": 2}]}'
    cut = TWO_CALLS[: TWO_CALLS.index('"b"')]  # inside the second call's arguments
    assert [c["function"]["name"] for c in forced_calls(cut)] == ["get_weather", "add"]
    assert forced_calls(cut)[1]["function"]["arguments"] == '{"a": [1, {'  # as streamed
    # before the first call's name: the grammar's JSON is not the model's words, no content
    assert forced_calls(TWO_CALLS[:20]) == [] and plan.calls(TWO_CALLS[:20]) == (None, [])


def test_auto_parses_every_call_and_only_the_first_without_parallel_calls() -> None:
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    )
    assert len(tool_plan([WEATHER, ADD], "auto").calls(text)[1]) == 2
    assert len(tool_plan([WEATHER, ADD], "auto", parallel=False).calls(text)[1]) == 1


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]',
        '{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}',
    ],
)
def test_plain_json_calls_as_an_array_or_one_after_another(text) -> None:
    content, calls = parse_calls(text, KNOWN)
    assert content is None
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1}, {"a": 2}]
    stream = tool_plan([WEATHER, ADD], "auto").stream()
    assert stream.feed(text) == []
    assert [d for d in stream.end() if "id" in d["tool_calls"][0]][1]["tool_calls"][0]["index"] == 1
