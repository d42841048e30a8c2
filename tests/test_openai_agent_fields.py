"""Request fields of the HTTP API for agents and vLLM's extensions, as the gateway reads them
(no stack): tool and developer messages are accepted and rendered, every field that would change
the result and is not implemented is refused naming it, stop strings can be kept, context
overflow speaks vLLM's words with OpenAI's code, and a 429 says when to retry."""

from __future__ import annotations

import json

import grpc
import pytest

from gateway.context_fit import completion_budget, completion_overflow, prompt_overflow
from gateway.generation_errors import ContextLengthExceeded, QueueFull
from gateway.http_errors import ApiError, from_generation
from gateway.openai_requests import ChatCompletionRequest, CompletionRequest
from gateway.stops import StopMatcher
from gateway.tokenizer import TemplateRoles, _compile_chat_template, template_messages

CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
AGENT_TURN = [
    {"role": "developer", "content": "Use the tools."},
    {"role": "user", "content": "1 + 2?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    {"role": "tool", "tool_call_id": "call_2", "content": "4"},
]
PLAIN = TemplateRoles(developer=False, tools=False)
# a template with tool support in the manner of Qwen2.5's (tool results and calls of its own)
TOOL_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments.a }}{% endfor %}{% endif %}"
    "{% if m.role == 'tool' %}RESULT {{ m.tool_call_id }}={% endif %}{{ m.content or '' }}"
    "{% endfor %}"
)


def chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.parse(json.dumps(body).encode())


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.parse(json.dumps({"prompt": "hi", **fields}).encode())


def refusal(make, **fields) -> ApiError:
    with pytest.raises(ApiError) as err:
        make(**fields).generate_input()
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    return err.value


# ---- messages --------------------------------------------------------------------------------


def test_an_agents_second_turn_is_accepted_with_what_the_template_needs() -> None:
    turns = chat(messages=AGENT_TURN).generate_input().messages
    assert [t.role for t in turns] == ["developer", "user", "assistant", "tool", "tool"]
    assert turns[2].content == "" and turns[2].extra == {"tool_calls": [CALL]}
    assert turns[3].extra == {"tool_call_id": "call_1"} and turns[3].content == "3"


def test_a_tool_message_without_its_call_id_is_refused_naming_the_field() -> None:
    err = refusal(chat, messages=[{"role": "tool", "content": "3"}])
    assert err.param == "messages[0].tool_call_id"


def test_tool_calls_on_a_user_message_are_refused() -> None:
    err = refusal(chat, messages=[{"role": "user", "content": "x", "tool_calls": [CALL]}])
    assert err.param == "messages[0].tool_calls"


def test_without_tool_support_the_template_gets_the_plain_tool_format() -> None:
    assert template_messages(_template_input(), PLAIN) == [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "1 + 2?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
        },
        {  # consecutive results: one user turn, in the order of the calls
            "role": "user",
            "content": "<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n</tool_response>",
        },
    ]


def test_a_template_with_tool_support_renders_tool_turns_itself() -> None:
    source = TOOL_TEMPLATE
    roles = TemplateRoles.of(source)
    assert roles == TemplateRoles(developer=False, tools=True)
    rendered = template_messages(_template_input(), roles)
    text = _compile_chat_template(source).render(messages=rendered)
    # the call's arguments reach the template as an object (.a), the results with their ids
    assert text == (
        "[system]Use the tools.[user]1 + 2?[assistant]CALL add 1"
        "[tool]RESULT call_1=3[tool]RESULT call_2=4"
    )


def _template_input() -> list[dict]:
    """The agent's turn as the generation path hands it to the chat template (gateway.core)."""
    turns = chat(messages=AGENT_TURN).generate_input().messages
    return [{"role": t.role, "content": t.content} | (t.extra or {}) for t in turns]


# ---- fields not implemented yet ----------------------------------------------------------------

REFUSED = {
    "add_generation_prompt": False,
    "continue_final_message": True,
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False},
    "documents": [{"text": "x"}],
    "prompt_logprobs": 1,
    "truncate_prompt_tokens": 10,
    "return_tokens_as_token_ids": True,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "allowed_token_ids": [1, 2],
    "bad_words": ["x"],
    "spaces_between_special_tokens": False,
    "add_special_tokens": True,
    "modalities": ["text", "audio"],
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_field_not_implemented_is_refused_naming_it(name: str) -> None:
    err = refusal(chat, **{name: REFUSED[name]})
    assert err.param == name and name in err.message


@pytest.mark.parametrize("name", ["prompt_logprobs", "use_beam_search", "truncate_prompt_tokens"])
def test_completions_refuse_them_too(name: str) -> None:
    assert refusal(completion, **{name: REFUSED[name]}).param == name


def test_their_neutral_values_are_served() -> None:
    neutral = {"add_generation_prompt": True, "chat_template_kwargs": {}}
    chat(**neutral).generate_input()
    completion(add_special_tokens=True, length_penalty=1.0).generate_input()


def test_priority_and_slo_class_reach_the_generation_path_as_sent() -> None:
    """Checked there against the API key (gateway/request_tenancy.py), as gRPC's are."""
    for make in (chat, completion):
        job = make(priority=-3, slo_class="batch").generate_input()
        assert (job.priority, job.slo_class) == (-3, "batch")
        assert make(priority="high").generate_input().priority == "high"  # refused there
        assert (make().generate_input().priority, make().generate_input().slo_class) == (None, "")


def test_stop_strings_kept_and_special_tokens_reach_the_generation_path() -> None:
    job = completion(include_stop_str_in_output=True, skip_special_tokens=False).generate_input()
    assert job.include_stop and not job.skip_special_tokens and job.fit_context
    default = completion().generate_input()
    assert not default.include_stop and default.skip_special_tokens


def test_include_stop_keeps_the_stop_string_however_the_text_is_split() -> None:
    text = "one two STOP three"
    for size in (1, 2, 5, len(text)):
        matcher = StopMatcher(["STOP"], include_stop=True)
        pieces = [matcher.push(text[i : i + size]) for i in range(0, len(text), size)]
        assert "".join(p for p, _ in pieces) == "one two STOP"


def test_continuous_usage_needs_include_usage() -> None:
    asked = chat(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )
    assert asked.continuous_usage
    assert not chat(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage


# ---- the context, range errors and 429 ---------------------------------------------------------


def test_context_overflow_is_worded_as_vllm_words_it() -> None:
    assert completion_overflow(2778, 8000, 4096) == (
        "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum "
        "context length is 4096 tokens and your request has 2778 input tokens "
        "(8000 > 4096 - 2778). (context_length_exceeded)"
    )
    assert "maximum context length is 1536 tokens" in prompt_overflow(4176, 1536)
    assert completion_overflow(10, 6, 16) is None and prompt_overflow(15, 16) is None
    assert completion_budget(10, None, 16) == 6 and completion_budget(10, 3, 16) == 3


def test_context_overflow_is_400_with_openais_code_and_the_field() -> None:
    err = from_generation(ContextLengthExceeded(completion_overflow(5, 10, 8), "max_tokens"))
    assert err.status == 400
    body = err.body()["error"]
    assert (body["code"], body["param"]) == ("context_length_exceeded", "max_tokens")


def test_a_full_queue_says_when_to_retry() -> None:
    response = from_generation(QueueFull("the queue is full")).response()
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert "retry-after" not in ApiError(grpc.StatusCode.INVALID_ARGUMENT, "x").response().headers
