"""The HTTP API in-process (Starlette's test client), its model a script: the answer's text is
given, so that what a model rarely writes (a forced call cut by max_tokens, a tool block of
broken JSON) is served as the API serves it, whole and streamed. The two forms of one request
agree; /tokenize counts what the chat's usage counts; the request checks name the fault.
The sweep of 2026-12-06 (F1-F8) found each of these answers wrong."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from starlette.testclient import TestClient

from gateway.core import Delta, Finish
from gateway.http_api import HttpApi
from gateway.intake import GenerateInput, Intake
from gateway.key_table import KeyTable
from gateway.settings import GatewaySettings
from gateway.tokenizer_files import load_tokenizer
from llmcommon.v1 import common_pb2

MODEL = "scripted"
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ADD = {"type": "function", "function": {"name": "add"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
LENGTH, STOP = common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP
pytestmark = pytest.mark.usefixtures("hang_guard")


class Claim:
    def close(self) -> None:
        pass


@dataclass
class ScriptedCore:
    """What HttpApi asks of a GatewayCore, the generation a script: `answer` in pieces of
    `piece` characters, then `reason`; the prompt rendered and counted by the real intake."""

    answer: str = "Hello."
    reason: int = STOP
    piece: int = 3
    model: str = MODEL
    max_context: int = 2048
    refusal: str | None = None
    settings: GatewaySettings = field(default_factory=GatewaySettings)
    tokenizer: object = field(default_factory=lambda: load_tokenizer(""))
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))
    jobs: list[GenerateInput] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keys = KeyTable(self.settings)
        self.intake = Intake(self.settings, self.tokenizer, self.max_context, self.pool)

    async def prepare(self, job: GenerateInput):
        return await self.intake.prepare(job)

    def claim(self, n: int) -> Claim:
        return Claim()

    async def generate(self, job, remaining, rid="", key=None, claim=None) -> AsyncIterator:
        self.jobs.append(job)
        _, ids = await self.prepare(job)
        pieces = [self.answer[i : i + self.piece] for i in range(0, len(self.answer), self.piece)]
        for i, text in enumerate(pieces):
            await asyncio.sleep(0)
            yield Delta(text, [i], prompt_tokens=len(ids))
        usage = common_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(pieces))
        yield Finish(rid, self.reason, usage)


@pytest.fixture
def core() -> ScriptedCore:
    return ScriptedCore()


@pytest.fixture
def http(core) -> TestClient:
    with TestClient(HttpApi(core).app(), base_url="http://127.0.0.1") as client:
        yield client


def chat(http: TestClient, **body) -> dict:
    reply = http.post("/v1/chat/completions", json={"messages": ASK} | body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def streamed(http: TestClient, **body) -> tuple[list[dict], dict]:
    """The stream's chunks' first choices, and what a client accumulating them has (as the
    openai SDK's stream helper does): content (None if no chunk carried any), tool calls,
    finish reason."""
    chunks = []
    body = {"messages": ASK, "stream": True} | body
    with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += json.loads(line[len("data: ") :])["choices"]
    content, calls, reason = None, {}, None
    for chunk in chunks:
        delta = chunk["delta"]
        if delta.get("content") is not None:
            content = (content or "") + delta["content"]
        for part in delta.get("tool_calls") or []:
            call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
            call["name"] += part.get("function", {}).get("name") or ""
            call["arguments"] += part.get("function", {}).get("arguments") or ""
        reason = chunk["finish_reason"] or reason
    return chunks, {
        "content": content,
        "tool_calls": [calls[i] for i in sorted(calls)],
        "reason": reason,
    }


def whole(choice: dict) -> dict:
    message = choice["message"]
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls") or []
    ]
    return {"content": message["content"], "tool_calls": calls, "reason": choice["finish_reason"]}


# ---- F1: a forced call cut by max_tokens --------------------------------------------------


@pytest.mark.parametrize(
    ("choice", "cut"),
    [
        ("required", '[{"name": "get_weather", "arguments": {"city'),
        (NAMED, '{"name": "get_weather", "arguments": {"city":'),
    ],
)
def test_a_forced_call_cut_by_max_tokens_is_a_call_whole_and_streamed(core, http, choice, cut):
    core.answer, core.reason = cut, LENGTH
    body = {"tools": [WEATHER, ADD], "tool_choice": choice, "max_tokens": 14}
    answer = whole(chat(http, **body))
    arguments = cut[cut.index('"arguments": ') + len('"arguments": ') :]
    expected = {
        "content": None,
        "tool_calls": [{"name": "get_weather", "arguments": arguments}],
        "reason": "length",
    }
    assert answer == expected
    assert streamed(http, **body)[1] == expected


def test_a_forced_answer_cut_before_the_name_has_neither_call_nor_content(core, http):
    core.answer, core.reason = '[{"name": "get_w', LENGTH
    body = {"tools": [WEATHER, ADD], "tool_choice": "required", "max_tokens": 5}
    expected = {"content": None, "tool_calls": [], "reason": "length"}
    assert whole(chat(http, **body)) == expected
    assert streamed(http, **body)[1] == expected


# ---- F3: an auto block of broken JSON -------------------------------------------------------

BROKEN = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": }\n</tool_call>'


@pytest.mark.parametrize(
    "answer",
    [
        BROKEN,
        "Let me add. " + BROKEN,
        '<tool_call>{"name": "add", "arguments": {"a": 1}} and more</tool_call>',
    ],
)
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_a_tool_block_that_is_not_json_is_text_whole_and_streamed(core, http, answer, piece):
    core.answer, core.piece = answer, piece
    body = {"tools": [WEATHER, ADD]}
    expected = {"content": answer, "tool_calls": [], "reason": "stop"}
    assert whole(chat(http, **body)) == expected
    assert streamed(http, **body)[1] == expected


def test_a_good_call_after_a_broken_block_stands_in_both(core, http):
    core.answer = BROKEN + '\n<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    body = {"tools": [WEATHER, ADD]}
    expected = {
        "content": BROKEN,
        "tool_calls": [{"name": "add", "arguments": '{"a": 2}'}],
        "reason": "tool_calls",
    }
    assert whole(chat(http, **body)) == expected
    assert streamed(http, **body)[1] == expected


# ---- F8: a streamed forced call opens with null content -----------------------------------


def test_a_streamed_forced_call_opens_with_null_content(core, http):
    core.answer = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    chunks, answer = streamed(http, tools=[WEATHER], tool_choice=NAMED)
    assert chunks[0]["delta"] == {"role": "assistant", "content": None}
    assert all(c["delta"].get("content") is None for c in chunks)
    assert answer == whole(chat(http, tools=[WEATHER], tool_choice=NAMED))
    assert answer["content"] is None and answer["reason"] == "tool_calls"


def test_a_streamed_answer_without_a_forced_call_opens_with_empty_content(core, http):
    chunks, _ = streamed(http, tools=[WEATHER])
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    chunks, _ = streamed(http)
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}


# ---- F2: /tokenize counts what the chat counts ---------------------------------------------


@pytest.mark.parametrize(
    "tools",
    [
        {},
        {"tools": [WEATHER, ADD]},
        {"tools": [WEATHER, ADD], "tool_choice": "auto"},
        {"tools": [WEATHER, ADD], "tool_choice": "required"},
        {"tools": [WEATHER, ADD], "tool_choice": NAMED},
        {"tools": [WEATHER, ADD], "tool_choice": "none"},
        {"tools": [WEATHER, ADD], "parallel_tool_calls": False},
        {"response_format": {"type": "json_object"}},
    ],
)
def test_tokenize_counts_the_chats_prompt_tokens(core, http, tools):
    count = http.post("/tokenize", json={"messages": ASK} | tools).json()["count"]
    core.answer = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    reply = http.post("/v1/chat/completions", json={"messages": ASK} | tools)
    assert reply.status_code == 200, reply.text
    assert count == reply.json()["usage"]["prompt_tokens"]
    if tools.get("tools") and tools.get("tool_choice") != "none":
        bare = http.post("/tokenize", json={"messages": ASK}).json()["count"]
        assert count > bare + 20  # the tools are in the prompt


def test_tokenize_refuses_what_it_would_not_render_as_the_chat_does(http):
    for body, param in (
        ({"messages": ASK, "tools": [WEATHER], "tool_choice": "nope"}, "tool_choice"),
        ({"messages": ASK, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"prompt": "hi", "tools": [WEATHER]}, "tools"),
        ({"messages": ASK, "add_generation_prompt": False}, "add_generation_prompt"),
        ({"messages": ASK, "chat_template": "{{ 1 }}"}, "chat_template"),
        ({"prompt": ""}, "prompt"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ):
        reply = http.post("/tokenize", json=body)
        assert reply.status_code == 400, body
        assert reply.json()["error"]["param"] == param, reply.json()


# ---- F4, F5, F6, F7: the request's checks ---------------------------------------------------


@pytest.mark.parametrize(
    "nulls",
    [
        {"stream": None},
        {"ignore_eos": None, "include_stop_str_in_output": None, "skip_special_tokens": None},
    ],
)
def test_null_booleans_are_their_defaults(core, http, nulls):
    assert chat(http, max_tokens=2, **nulls)["message"]["content"] == core.answer
    assert core.jobs[-1].skip_special_tokens and not core.jobs[-1].include_stop


def test_stream_options_nulls_are_false(http):
    body = {"stream": True, "stream_options": {"include_usage": None}}
    chunks, answer = streamed(http, **body)
    assert answer["content"] == "Hello."


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "/v1/completions/", "/tokenize/"])
def test_a_trailing_slash_is_no_route_not_a_redirect(http, path):
    reply = http.post(
        path, json={"messages": ASK}, headers={"host": "attacker.example"}, follow_redirects=False
    )
    assert reply.status_code == 404 and "location" not in reply.headers
    assert reply.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/chat/completions", {"messages": ASK, "stop": ["a", 1]}, "stop[1]", "valid string"),
        ("/v1/chat/completions", {"messages": ASK, "logit_bias": {"99999999": 1}}, "logit_bias",
         "99999999"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [99999999]}, "stop_token_ids",
         "99999999"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, "echo", "(or at false)"),
        ("/tokenize", {"prompt": ""}, "prompt", "empty"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content",
         "Missing required parameter: 'messages[0].content'"),
        ("/v1/chat/completions", {"messages": [{"role": "system"}, *ASK]}, "messages[0].content",
         "messages[0].content"),
        ("/v1/chat/completions", {"messages": [*ASK, {"role": "assistant"}]},
         "messages[1].content", "messages[1].content"),
    ],
)  # fmt: skip
def test_a_refusal_names_the_fault(http, path, body, param, words):
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_an_assistant_turn_with_tool_calls_may_leave_its_content_out(http):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    messages = [
        *ASK,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    reply = http.post("/v1/chat/completions", json={"messages": messages, "tools": [ADD]})
    assert reply.status_code == 200, reply.text
    assert chat(http, messages=[{"role": "user", "content": None}])["finish_reason"] == "stop"
