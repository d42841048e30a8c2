"""An auto answer's stream (gateway/tools.py, AutoStream): whatever the pieces its text comes
in, the deltas add up to the answer parsed whole (content, each call's name and arguments as
written); a Hermes block is sent once its closing tag has come and it is judged a call, so a
block that is not one (broken JSON) is text in both, never a call half sent."""

from __future__ import annotations

import json
import random

import pytest

from gateway.tools import call_head, tool_plan

WEATHER = {"type": "function", "function": {"name": "get_weather"}}
ADD = {"type": "function", "function": {"name": "add"}}
CALL = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "}]\\"{"}]}}\n</tool_call>'
)
BROKEN = '<tool_call>{"name": "add", "arguments": {"a": broken</tool_call>'
# brackets balanced, JSON broken (the sweep's F3): the scan of the arguments ends, json does not
BALANCED = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": }\n</tool_call>'
ANSWERS = [
    "Just text, <b>no</b> call <tool",
    "Sure.\n" + CALL,
    CALL,
    'Two: <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
    + CALL
    + "\nDone.",
    '<tool_call>{ "name" : "add" ,\n "parameters" : { "a" : 3 } }</tool_call> after',
    '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>',  # head last: held whole
    '<tool_call>{"name": "add", "arguments": "{\\"a\\": 4}"}</tool_call>',  # a string: whole
    'A <tool_call>{"name": "unknown", "arguments": {}}</tool_call> B',  # not a call: text
    'Hi <tool_call>{"name": "add", "arguments": {"a": 5}}',  # no closing tag
    '{"name": "add", "arguments": {"a": 6}}',  # plain JSON: held whole
    'Let me see. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 7}}]',  # Mistral's
    '[TOOL_CALLS]add[ARGS]{"a": 8}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
    '<|python_tag|>{"name": "add", "parameters": {"a": 9}}',  # Llama 3.1's
    "[TOOL_CALLS] not a call, [1] and <|python",  # text
    BALANCED,  # not a call: text
    "Sure. " + BALANCED + " done",
    CALL + "\n" + BALANCED,  # the call stands, the broken block is text
    BALANCED + "\n" + CALL,
    '<tool_call>{"name": "add", "arguments": {"a": 1}} junk</tool_call>',  # not JSON: text
    'Hm <tool_call>{"name": "add", "arguments": {"a": 1',  # cut inside the arguments: text
]


def added_up(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """What a client accumulating the deltas has (as the openai SDK's stream helpers do)."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
            call["name"] += part.get("function", {}).get("name", "")
            call["arguments"] += part.get("function", {}).get("arguments", "")
    return content or None, [calls[i] for i in sorted(calls)]


def streamed(plan, text: str, rng: random.Random) -> tuple[list[dict], bool]:
    stream = plan.stream()
    deltas, at = [], 0
    while at < len(text):
        size = rng.choice([1, 1, 2, 3, 5, 8, 30])
        deltas += stream.feed(text[at : at + size])
        at += size
    return deltas + stream.end(), stream.called


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("text", ANSWERS)
def test_the_deltas_add_up_to_the_answer_parsed_whole_in_any_pieces(text, parallel) -> None:
    plan = tool_plan([WEATHER, ADD], "auto", parallel)
    content, calls = plan.calls(text)
    whole = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
    ]
    for seed in range(25):
        deltas, called = streamed(plan, text, random.Random(seed))
        assert added_up(deltas) == (content, whole)
        assert called == bool(calls)


def test_a_hermes_call_is_sent_once_its_block_has_closed() -> None:
    """The content first; nothing of the block until its closing tag, then the head and the
    arguments as written (none of the block's tail)."""
    plan = tool_plan([WEATHER, ADD], "auto")
    stream = plan.stream()
    text = "Sure.\n" + CALL
    close = text.index("</tool_call>")
    before = [d for i in range(close) for d in stream.feed(text[i])]
    assert "".join(d["content"] for d in before) == "Sure."  # and no tool_calls delta
    deltas = stream.feed(text[close:]) + stream.end()
    parts = [d["tool_calls"][0] for d in deltas]
    assert parts[0]["function"] == {"name": "add", "arguments": ""} and "id" in parts[0]
    assert parts[1] == {
        "index": 0,
        "function": {"arguments": '{"a": 1, "b": [2, {"c": "}]\\"{"}]}'},
    }
    assert len(parts) == 2 and stream.called


def test_a_call_cut_short_inside_its_arguments_is_text() -> None:
    plan = tool_plan([ADD], "auto")
    stream = plan.stream()
    text = '<tool_call>{"name": "add", "arguments": {"a": 1'
    assert stream.feed(text) == []  # held: not judged yet
    assert stream.end() == [{"content": text}] and not stream.called


def test_a_block_with_balanced_brackets_but_broken_json_is_text_not_a_call() -> None:
    """The sweep's F3: the scan of its arguments ended, but they are not JSON. Streamed, it
    was sent as a call (finish_reason tool_calls, arguments that do not parse); not streamed,
    it was text (stop). Both are text now."""
    plan = tool_plan([ADD], "auto")
    assert plan.calls(BALANCED) == (BALANCED, [])
    for seed in range(10):
        deltas, called = streamed(plan, BALANCED, random.Random(seed))
        assert deltas and all("tool_calls" not in d for d in deltas) and not called
        assert added_up(deltas) == (BALANCED, [])


def test_a_block_whose_arguments_never_end_leaves_the_calls_before_it() -> None:
    """It is not a call and nothing of it went as one; the one before it stands."""
    plan = tool_plan([ADD], "auto")
    deltas, called = streamed(plan, CALL + BROKEN, random.Random(1))
    assert called and {d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d} == {0}
    assert added_up(deltas) == (BROKEN, added_up(streamed(plan, CALL, random.Random(1))[0])[1])


@pytest.mark.parametrize(
    ("text", "head"),
    [
        ('{"name": "add", "arguments": {', ("add", 29)),
        (' { "name":"a-b" , "parameters" :\n{"x"', ("a-b", 33)),
        ('{"name": "ad', True),
        ('{"name": "add", "argu', True),
        ("", True),
        ('{"arguments": {', False),
        ('{"name": "add", "arguments": "', False),
        ('{"name": "a b"', False),
    ],
)
def test_a_blocks_head_is_whole_maybe_to_come_or_not_one(text, head) -> None:
    assert call_head(text) == head


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, '
         '{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
         "Sure.", [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})]),
        ('[TOOL_CALLS]add[ARGS]{"a": 2}', None, [("add", {"a": 2})]),
        ('<|python_tag|>{"name": "add", "parameters": {"a": 3}}', None, [("add", {"a": 3})]),
        ("[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
        ('[TOOL_CALLS]unknown[ARGS]{"a": 2}', '[TOOL_CALLS]unknown[ARGS]{"a": 2}', []),
    ],
)  # fmt: skip
def test_mistral_and_llama_marked_calls_are_parsed(text, content, calls) -> None:
    plan = tool_plan([WEATHER, ADD], "auto")
    got_content, got = plan.calls(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


FORCED = [
    ('[{"name": "get_weather", "arguments": {"city": "Oslo \\"}{ ]"}}, '
     '{"name": "add", "arguments": {"a": [1, {"b": 2}]}}]', "required"),
    ('{"name": "add", "arguments": {"a": 1, "b": [2]}}',
     {"type": "function", "function": {"name": "add"}}),
]  # fmt: skip


@pytest.mark.parametrize(("text", "choice"), FORCED)
def test_a_forced_answer_cut_anywhere_streams_what_it_answers_whole(text, choice) -> None:
    """The sweep's F1: cut by max_tokens inside a call's arguments, the whole answer held the
    grammar's JSON as content while the stream had sent the call. Now both hold every call whose
    name came, the last with the arguments generated so far, and no content."""
    plan = tool_plan([WEATHER, ADD], choice)
    for cut in range(len(text) + 1):
        content, calls = plan.calls(text[:cut])
        whole = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
        ]
        deltas, called = streamed(plan, text[:cut], random.Random(cut))
        assert content is None and added_up(deltas) == (None, whole)
        assert called == bool(calls)
    cut = text[: text.index("[2") if "[2" in text else text.index('"b"')]
    name = plan.calls(cut)[1][-1]["function"]["name"]
    assert name == "add" and plan.calls(cut)[1][-1]["function"]["arguments"].startswith('{"a"')
