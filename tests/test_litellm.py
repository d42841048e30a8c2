"""litellm against the HTTP API through real processes (tiny model): a completion, a stream, a
tool call under tool_choice required, and a prompt + max_tokens over the context raised as
litellm's ContextWindowExceededError (it knows vLLM's wording)."""

from __future__ import annotations

import json
import os

import pytest

from tests.stacks import running_stack, tiny_settings, with_http_port

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price list: no download
litellm = pytest.importorskip("litellm")  # requirements-bench.txt; CI installs it
pytestmark = pytest.mark.usefixtures("hang_guard")
ASK = [{"role": "user", "content": "What is 1 + 2?"}]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings = with_http_port(tiny_settings(max_running=4))
    with running_stack(settings, tmp_path_factory.mktemp("litellm")) as s:
        yield s


@pytest.fixture(scope="module")
def ask(stack):
    def asking(**fields):
        sent = dict(model="openai/tiny", api_base=stack.settings.http_url, api_key="-")
        return litellm.completion(**sent, messages=ASK, num_retries=0, **fields)

    return asking


def test_a_completion_and_a_stream(ask) -> None:
    reply = ask(max_tokens=5, temperature=0, ignore_eos=True)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 5
    assert reply.choices[0].finish_reason == "length"
    chunks = list(ask(max_tokens=5, temperature=0, ignore_eos=True, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content


def test_a_required_tool_call(ask) -> None:
    reply = ask(tools=[ADD], tool_choice="required", parallel_tool_calls=False, max_tokens=100)
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "add"
    assert 0 <= json.loads(call.function.arguments)["a"] <= 99


def test_a_context_overflow_is_litellms_context_window_error(ask) -> None:
    with pytest.raises(litellm.ContextWindowExceededError) as caught:
        ask(max_tokens=10**6)
    assert "maximum context length" in str(caught.value)
