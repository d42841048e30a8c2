"""Where the offered tools go (tool_choice auto): to a chat template that reads `tools` (as
transformers' `apply_chat_template(..., tools=...)` hands them), else into Hermes' system prompt
joined to the first system turn; the answer of a template's own format is parsed."""

from __future__ import annotations

import copy
import json

import pytest

from gateway.tokenizer import Tokenizer, load_default_tokenizer
from gateway.tools import tool_plan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# Qwen2.5's shape: the tools in a system block of their own, each as JSON
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return load_default_tokenizer()


@pytest.fixture(scope="module")
def qwen_like(smollm2) -> Tokenizer:
    tok = copy.copy(smollm2)
    tok._chat_template_source, tok._chat_template = QWEN_LIKE, None
    return tok


def test_a_template_that_reads_tools_gets_them_and_no_system_prompt(qwen_like) -> None:
    text = qwen_like.apply_chat_template(ASK, tool_plan([WEATHER], "auto").described())
    assert json.loads(text.split("# Tools\n")[1].split("\n")[0]) == WEATHER
    assert "<tools>" not in text and text.endswith("<|im_start|>assistant\n")
    assert "# Tools" not in qwen_like.apply_chat_template(ASK)


def test_a_template_without_tools_gets_hermes_system_prompt(smollm2) -> None:
    tools = tool_plan([WEATHER], "auto").described()
    text = smollm2.apply_chat_template(ASK, tools)
    assert text.startswith("<|im_start|>system\nYou are a function calling AI model.")
    assert '"name": "get_weather"' in text and "named SmolLM" not in text
    joined = smollm2.apply_chat_template([{"role": "system", "content": "Be brief."}, *ASK], tools)
    assert joined.startswith("<|im_start|>system\nBe brief.\n\nYou are a function calling")


@pytest.mark.parametrize(
    "answer",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',  # Llama 3.1's plain JSON
    ],
)
def test_the_answer_of_either_format_is_a_call(answer) -> None:
    content, calls = tool_plan([WEATHER], "auto").calls(answer)
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
