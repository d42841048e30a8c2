"""Tools' pure logic (gateway/tools.py): tools and tool_choice read or refused naming the field,
the auto parser (tolerant; text without a call is an answer), a forced call's stream deltas."""

from __future__ import annotations

import json

import pytest

from gateway.tools import ToolsProblem, forced_call, parse_calls, tool_plan

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
    assert '"name": "get_weather"' in (auto.system_prompt() or "")
    named = tool_plan([WEATHER, ADD], {"type": "function", "function": {"name": "add"}})
    assert named is not None and [f.name for f in named.functions] == ["add"]
    schema = json.loads(named.grammar().spec)
    assert schema["properties"]["name"] == {"const": "add"}
    required = tool_plan([WEATHER, ADD], "required")
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


def test_an_auto_stream_sends_content_as_it_comes_then_each_call() -> None:
    plan = tool_plan([WEATHER, ADD], "auto")
    assert plan is not None
    stream = plan.stream()
    assert stream.feed("Sure") == [{"content": "Sure"}]
    assert stream.feed(". <tool") == [{"content": "."}]  # maybe a call's tag: held back
    assert stream.feed('_call>\n{"name": "add", ') == []
    assert stream.feed('"arguments": {"a": 1}}\n</tool_call>') == []
    head, arguments = stream.end()
    assert stream.called
    assert head["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert arguments["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"a": 1}'}}


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
