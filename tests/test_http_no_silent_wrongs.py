"""The HTTP API gives what was asked or a clear no, through real processes (tiny model) with the
real `openai` SDK and LangChain: an agent's second turn (developer, assistant tool_calls, tool
results) is served; a prompt + max_tokens over the context is vLLM's 400 that LangChain knows as a
context overflow; max_tokens left out is the rest of the context (completions: 16); vLLM's
stop, special-token and usage fields work; cached prompt tokens are told; /metrics is the
operator's."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import replace

import openai
import pytest

from llmserve import client
from tests.stacks import free_run, running_stack, tiny_settings

pytestmark = pytest.mark.usefixtures("hang_guard")
TOKEN = "operator-s3cret"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
AGENT_TURN = [
    {"role": "developer", "content": "Answer with the tool's result."},
    {"role": "user", "content": "What is 1 + 2?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings = tiny_settings()
    ports = free_run(4, [settings.gateway_port, settings.scheduler_port, settings.worker_base_port])
    settings = replace(settings, http_port=ports + 3, metrics_base_port=ports)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LLMSERVE_INTERNAL_TOKEN", TOKEN)
        with running_stack(settings, tmp_path_factory.mktemp("silent")) as s:
            yield s


@pytest.fixture(scope="module")
def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.settings.http_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def context(stack) -> int:
    return client.status(stack.settings.scheduler, token=TOKEN).max_context


def post(stack, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    url = f"http://127.0.0.1:{stack.settings.http_port}{path}"
    sent = {"content-type": "application/json"} | (headers or {})
    request = urllib.request.Request(url, json.dumps(body).encode(), sent, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def prompt_of(stack, tokens: int) -> tuple[str, int]:
    """A completion prompt of about `tokens` tokens, and its exact count."""
    text = " x" * tokens
    status, counted = post(stack, "/tokenize", {"prompt": text})
    assert status == 200, counted
    return text, counted["count"]


def test_an_agents_second_turn_is_served_with_the_tool_result_rendered(stack, sdk) -> None:
    reply = sdk.chat.completions.create(model="tiny", messages=AGENT_TURN, max_tokens=3, **GREEDY)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    status, counted = post(stack, "/tokenize", {"messages": AGENT_TURN})
    assert status == 200 and counted["count"] == reply.usage.prompt_tokens
    _, text = post(stack, "/detokenize", {"tokens": counted["tokens"]})
    rendered = text["prompt"]
    assert "<|im_start|>system\nAnswer with the tool's result.<|im_end|>" in rendered
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in rendered
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>" in rendered


def test_max_tokens_past_the_context_is_vllms_400_that_clients_recognise(
    stack, sdk, context
) -> None:
    text, count = prompt_of(stack, context - 40)
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model="tiny", prompt=text, max_tokens=100)
    error = err.value.body
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
    assert f"maximum context length is {context} tokens" in error["message"]
    assert f"your request has {count} input tokens" in error["message"]


def test_langchain_sees_a_context_overflow(stack, context) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.exceptions import ContextOverflowError

    chat = langchain_openai.ChatOpenAI(
        base_url=stack.settings.http_url, api_key="x", model="tiny", max_tokens=context,
        max_retries=0, timeout=60,
    )  # fmt: skip
    with pytest.raises(ContextOverflowError):
        chat.invoke("Hello there")


def test_max_tokens_null_is_the_rest_of_the_context_and_left_out_16(stack, sdk, context) -> None:
    """Completions as OpenAI's and vLLM's: max_tokens left out is 16; null is the rest of the
    context (chat's default, as vLLM's)."""
    text, count = prompt_of(stack, context - 300)  # the rest: more than the 128 of gRPC
    rest = GREEDY | {"extra_body": GREEDY["extra_body"] | {"max_tokens": None}}
    reply = sdk.completions.create(model="tiny", prompt=text, **rest)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == context - count
    short = sdk.completions.create(model="tiny", prompt=text, **GREEDY)
    assert short.choices[0].finish_reason == "length"
    assert short.usage.completion_tokens == 16


def test_include_stop_str_in_output_keeps_the_stop(sdk) -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, **GREEDY}
    free = sdk.completions.create(**body).choices[0].text
    stop = free[4:7]
    assert stop and stop in free
    cut = sdk.completions.create(**body | {"stop": [stop]}).choices[0].text
    kept = (
        sdk.completions.create(
            **body
            | {
                "stop": [stop],
                "extra_body": GREEDY["extra_body"] | {"include_stop_str_in_output": True},
            }
        )
        .choices[0]
        .text
    )
    assert cut == free[: free.index(stop)] and kept == cut + stop


def test_skip_special_tokens_false_shows_them(sdk) -> None:
    # logit_bias makes <|im_start|> (id 1, a special token) the only likely token
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "logit_bias": {"1": 100}, **GREEDY}
    assert sdk.completions.create(**body).choices[0].text == ""
    shown = sdk.completions.create(
        **body | {"extra_body": GREEDY["extra_body"] | {"skip_special_tokens": False}}
    )
    assert shown.choices[0].text == "<|im_start|>" * 3


def test_continuous_usage_stats_give_the_usage_in_every_chunk(sdk) -> None:
    chunks = list(
        sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY,
        )
    )  # fmt: skip
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    completed = [u.completion_tokens for u in usages]
    assert completed == sorted(completed) and completed[0] == 0 and completed[-1] == 5
    assert len({u.prompt_tokens for u in usages}) == 1 and usages[0].prompt_tokens > 0


def test_a_repeated_prompt_reports_its_cached_tokens(sdk) -> None:
    prompt = "The same long prompt, word for word, sent twice. " * 8
    first, second = (
        sdk.completions.create(model="tiny", prompt=prompt + tail, max_tokens=1, **GREEDY)
        for tail in ("one", "two")
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0  # whole blocks


def test_the_grpc_api_reports_cached_tokens_in_its_usage(stack) -> None:
    prompt = "Another long prompt, said twice over gRPC, word for word. " * 8
    finals = []
    for tail in ("one", "two"):
        request = client.make_request(prompt=prompt + tail, max_tokens=1, ignore_eos=True)
        replies = list(client.stream(stack.settings.gateway, request, timeout=60))
        finals.append(replies[-1].final.usage)
    assert finals[0].cached_tokens == 0 and finals[0].prompt_tokens > 0
    cached = finals[1].cached_tokens
    assert 0 < cached < finals[1].prompt_tokens and cached % 16 == 0  # whole blocks


def test_metrics_on_the_http_port_are_the_operators(stack, sdk) -> None:
    url = f"http://127.0.0.1:{stack.settings.http_port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=30)
    assert refused.value.code == 401
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        page = reply.read().decode()
    assert reply.status == 200 and "llmserve_gateway_requests_total" in page
    gateway_port = f"http://127.0.0.1:{stack.settings.metrics_base_port}/metrics"
    with urllib.request.urlopen(gateway_port, timeout=30) as port:
        families = {line.split(" ")[2] for line in port.read().decode().splitlines()
                    if line.startswith("# TYPE llmserve_gateway")}  # fmt: skip
    assert families and all(f"# TYPE {family} " in page for family in families)


@pytest.mark.parametrize(
    "field,value", [("use_beam_search", True), ("chat_template_kwargs", {"x": 1})]
)
def test_a_field_not_implemented_is_a_400_naming_it(sdk, field, value) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            extra_body={field: value},
        )  # fmt: skip
    assert err.value.body["param"] == field
