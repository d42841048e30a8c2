"""The sampling settings through a real scheduler and worker (tiny model, fp32): logit_bias,
stop_token_ids, min_tokens, the penalties with a seed whatever the batch, and logprobs that equal
a recomputation by transformers."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from llmcommon.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.model_support import hf, model, tokenizer
from tests.stacks import free_port, running_stack, tiny_settings

pytestmark = pytest.mark.usefixtures("hang_guard")
PROMPT = [1, 17, 42, 99, 7, 250, 3, 88, 12]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    settings = tiny_settings(http_port=free_port())
    with running_stack(settings, tmp_path_factory.mktemp("sampling")) as s:
        yield s


def submit(stack, prompt=PROMPT, **sampling) -> tuple[list[int], list, int]:
    """Tokens, logprobs and finish reason of one request sent to the scheduler."""
    request = scheduler_pb2.SubmitRequest(
        prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(**sampling)
    )
    tokens, logprobs, finish = [], [], 0
    with grpc.insecure_channel(stack.settings.scheduler) as channel:
        for event in scheduler_pb2_grpc.SchedulerStub(channel).Submit(request, timeout=60):
            tokens += event.token_ids
            logprobs += event.logprobs
            finish = event.finish_reason or finish
    return tokens, logprobs, finish


def test_logit_bias_forces_a_token_under_greedy(stack) -> None:
    tokens, _, _ = submit(stack, max_tokens=5, temperature=0, ignore_eos=True, logit_bias={77: 100})
    assert tokens == [77] * 5


def test_a_stop_token_id_ends_the_request_and_min_tokens_holds_it_off(stack) -> None:
    forced = dict(temperature=0, logit_bias={77: 100}, stop_token_ids=[77], max_tokens=8)
    tokens, _, finish = submit(stack, **forced)
    assert (tokens, finish) == ([77], common_pb2.FINISH_REASON_STOP)
    tokens, _, finish = submit(stack, min_tokens=3, **forced)
    assert 77 not in tokens[:3] and tokens[3:] == [77]
    assert finish == common_pb2.FINISH_REASON_STOP


def test_seeded_penalized_draws_do_not_depend_on_the_batch(stack) -> None:
    seeded = dict(
        max_tokens=12,
        temperature=5.0,
        seed=5,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        min_p=0.05,
    )
    alone = submit(stack, **seeded)[0]
    others = [dict(max_tokens=12, temperature=1.0, ignore_eos=True)] * 3
    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(submit, stack, PROMPT, **s) for s in [seeded, *others]]
        together = runs[0].result()[0]
    assert together == alone and len(alone) == 12 and len(set(alone)) > 1


def test_logprobs_come_with_each_token_and_equal_a_recomputation(stack) -> None:
    tokens, logprobs, _ = submit(
        stack, max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, repetition_penalty=1.5
    )
    assert len(logprobs) == len(tokens) == 6
    assert model("tiny")[0].vocab_size  # the worker serves the same tiny model
    with torch.inference_mode():
        raw = hf("tiny")(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    expected = torch.log_softmax(raw.float(), dim=-1)
    for row, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        assert math.isclose(lp.logprob, float(expected[row, token]), abs_tol=1e-3)
        assert list(lp.top_ids) == expected[row].topk(2).indices.tolist()


def test_a_request_without_logprobs_gets_none(stack) -> None:
    tokens, logprobs, _ = submit(stack, max_tokens=3, temperature=0, ignore_eos=True)
    assert len(tokens) == 3 and logprobs == []


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("min_p", 2.0, "min_p"),
        ("presence_penalty", 3.0, "presence_penalty"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("logit_bias", {5: 500.0}, "logit_bias"),
        ("stop_token_ids", [10**6], "vocabulary"),
        ("logprobs", 21, "logprobs"),
        ("min_tokens", 9, "min_tokens"),
    ],
)
def test_bad_sampling_values_are_refused_with_a_reason(stack, field, value, words) -> None:
    with pytest.raises(grpc.RpcError) as err:
        submit(stack, max_tokens=4, **{field: value})
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()


# Through the gateway's gRPC API.


def generate(stack, **sampling) -> gateway_pb2.GenerateResult:
    request = gateway_pb2.GenerateRequest(
        prompt="Hello there", sampling=common_pb2.SamplingParams(**sampling)
    )
    with grpc.insecure_channel(stack.settings.gateway) as channel:
        return gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(request, timeout=60)


def test_the_gateway_passes_the_sampling_settings_and_returns_logprobs(stack) -> None:
    result = generate(
        stack, max_tokens=4, temperature=0, logit_bias={77: 100}, stop_token_ids=[77], min_tokens=2
    )
    assert 77 not in result.token_ids[:2] and result.token_ids[2:] == [77]
    assert result.finish_reason == common_pb2.FINISH_REASON_STOP
    result = generate(stack, max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)
    assert len(result.logprobs) == len(result.token_ids) == 3
    assert [lp.top_ids[0] for lp in result.logprobs] == list(result.token_ids)  # greedy


def test_the_gateway_refuses_bad_sampling_values_with_a_reason(stack) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(stack, max_tokens=4, frequency_penalty=-5)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "frequency_penalty" in err.value.details()


# Through the gateway's HTTP API.


def post(stack, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{stack.settings.http_url}{path}",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_http_sampling_fields_give_what_the_grpc_api_gives(stack) -> None:
    forced = dict(max_tokens=4, temperature=0, stop_token_ids=[77], min_tokens=2)
    expected = generate(stack, logit_bias={77: 100}, **forced)
    status, body = post(
        stack, "/completions", {"prompt": "Hello there", "logit_bias": {"77": 100}, **forced}
    )
    assert status == 200
    assert body["choices"][0]["text"] == expected.text
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(expected.token_ids) == 3
    penalized = dict(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, min_p=0.1)
    penalized |= dict(presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.2)
    status, body = post(stack, "/completions", {"prompt": "Hello there", **penalized})
    assert body["choices"][0]["text"] == generate(stack, **penalized).text


def test_the_stop_token_that_ended_a_request_counts_but_is_not_in_its_text(stack) -> None:
    # vLLM's rule: the token that stopped the request (a stop_token_id, or EOS with
    # skip_special_tokens false) is in the usage and the token ids, not in the text, unless
    # include_stop_str_in_output
    forced = dict(prompt="Hello there", max_tokens=4, temperature=0, min_tokens=2)
    stopped = forced | dict(logit_bias={"77": 100}, stop_token_ids=[77])
    status, body = post(stack, "/completions", stopped)
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    status, kept = post(stack, "/completions", stopped | {"include_stop_str_in_output": True})
    assert status == 200 and kept["usage"]["completion_tokens"] == 3
    stop_text = kept["choices"][0]["text"][len(body["choices"][0]["text"]) :]
    assert stop_text and kept["choices"][0]["text"] == body["choices"][0]["text"] + stop_text
    two = generate(stack, max_tokens=2, temperature=0, ignore_eos=True, logit_bias={77: -100})
    assert body["choices"][0]["text"] == two.text  # the same two tokens, and nothing after


def test_the_eos_that_ended_a_request_is_not_in_text_that_keeps_special_tokens(stack) -> None:
    eos = tokenizer().eos_token_id
    forced = dict(prompt="Hello there", max_tokens=4, temperature=0, min_tokens=2)
    forced |= dict(logit_bias={str(eos): 100}, skip_special_tokens=False)
    status, body = post(stack, "/completions", forced)
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3
    status, kept = post(stack, "/completions", forced | {"include_stop_str_in_output": True})
    eos_text = tokenizer().decode([eos])
    assert eos_text and kept["choices"][0]["text"] == body["choices"][0]["text"] + eos_text


@pytest.mark.parametrize(
    "field, value",
    [("frequency_penalty", 5), ("min_p", -0.5), ("logit_bias", {"x": 1}), ("min_tokens", -1)],
)
def test_http_refuses_bad_sampling_values_naming_the_field(stack, field, value) -> None:
    status, body = post(stack, "/completions", {"prompt": "Hi", "max_tokens": 4, field: value})
    assert status == 400
    assert field in body["error"]["message"]


def test_http_logprobs_in_openai_shape_equal_the_grpc_api_logprobs(stack) -> None:
    greedy = dict(max_tokens=4, temperature=0, ignore_eos=True)
    expected = generate(stack, logprobs=2, **greedy).logprobs
    body = {"prompt": "Hello there", "logprobs": 2, **greedy}
    status, reply = post(stack, "/completions", body)
    assert status == 200
    logprobs = reply["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == pytest.approx([lp.logprob for lp in expected], abs=1e-5)
    assert [len(top) for top in logprobs["top_logprobs"]] == [2] * 4
    assert len(logprobs["tokens"]) == len(logprobs["text_offset"]) == 4


def test_http_chat_logprobs_stream_and_whole_agree(stack) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    body |= {"ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    status, reply = post(stack, "/chat/completions", body)
    assert status == 200
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"] == 4
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"] <= 0
        assert entry["bytes"] == list(entry["token"].encode())
    request = urllib.request.Request(
        f"{stack.settings.http_url}/chat/completions",
        data=json.dumps(body | {"stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as stream:
        lines = [line for line in stream.read().decode().split("\n\n") if line]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    streamed = [entry for lp in logprobs if lp for entry in lp["content"]]
    assert streamed == content


def test_http_without_logprobs_answers_null(stack) -> None:
    status, reply = post(stack, "/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and reply["choices"][0]["logprobs"] is None


def test_n_choices_from_one_prompt_are_reproducible_with_a_seed(stack) -> None:
    body = {"prompt": "Hello there", "max_tokens": 8, "temperature": 5.0, "ignore_eos": True}
    status, reply = post(stack, "/completions", body | {"n": 3, "seed": 40, "logprobs": 0})
    assert status == 200
    choices = reply["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert reply["usage"]["completion_tokens"] == 24
    assert all(len(c["logprobs"]["token_logprobs"]) == 8 for c in choices)
    again = post(stack, "/completions", body | {"n": 3, "seed": 40, "logprobs": 0})[1]
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in choices]
    for i, choice in enumerate(choices):  # choice i is the request seeded seed + i
        alone = post(stack, "/completions", body | {"seed": 40 + i})[1]
        assert alone["choices"][0]["text"] == choice["text"]
    assert len({c["text"] for c in choices}) > 1


def test_n_chat_choices_each_carry_their_index_and_message(stack) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2}
    status, reply = post(stack, "/chat/completions", body | {"temperature": 0})
    assert status == 200
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    texts = [c["message"]["content"] for c in reply["choices"]]
    assert texts[0] == texts[1]  # greedy: the same answer twice


def test_n_streamed_choices_carry_their_index_and_match_the_whole_response(stack) -> None:
    body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 5.0, "seed": 9, "n": 3}
    body |= {"ignore_eos": True}
    whole = post(stack, "/completions", body)[1]
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(
        f"{stack.settings.http_url}/completions",
        data=json.dumps(body | streamed).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as stream:
        lines = [line for line in stream.read().decode().split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    texts, finishes = ["", "", ""], [None, None, None]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        finishes[choice["index"]] = choice["finish_reason"] or finishes[choice["index"]]
    assert texts == [c["text"] for c in whole["choices"]]
    assert finishes == ["length"] * 3
    assert chunks[-1]["usage"] == whole["usage"] and whole["usage"]["completion_tokens"] == 18


def test_n_streamed_chat_choices_each_open_with_the_role(stack) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2}
    request = urllib.request.Request(
        f"{stack.settings.http_url}/chat/completions",
        data=json.dumps(body | {"temperature": 0, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as stream:
        lines = [line for line in stream.read().decode().split("\n\n") if line]
    choices = [json.loads(line[6:])["choices"][0] for line in lines[:-1]]
    roles = [c["index"] for c in choices if c["delta"].get("role") == "assistant"]
    ends = sorted(c["index"] for c in choices if c["finish_reason"])
    texts = [
        "".join(c["delta"].get("content", "") for c in choices if c["index"] == i) for i in (0, 1)
    ]
    assert roles == [0, 1] and ends == [0, 1] and texts[0] == texts[1]  # greedy: twice the same


# n over gRPC: the same choices as HTTP's n.


def grpc_request(n: int | None, **sampling) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(
        prompt="Hello there", sampling=common_pb2.SamplingParams(**sampling)
    )
    if n is not None:
        request.n = n
    return request


def test_grpc_n_gives_the_choices_http_n_gives(stack) -> None:
    sampling = dict(max_tokens=6, temperature=5.0, seed=9, ignore_eos=True)
    with grpc.insecure_channel(stack.settings.gateway) as channel:
        result = gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(
            grpc_request(3, logprobs=0, **sampling), timeout=60
        )
    body = {"prompt": "Hello there", "n": 3, **sampling}
    http = post(stack, "/completions", body)[1]
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == [c["text"] for c in http["choices"]]
    assert (result.text, result.token_ids) == (result.choices[0].text, result.choices[0].token_ids)
    assert all(len(c.token_ids) == len(c.logprobs) == 6 for c in result.choices)
    assert result.usage.completion_tokens == 18 == http["usage"]["completion_tokens"]
    assert result.usage.prompt_tokens == http["usage"]["prompt_tokens"]
    assert len({c.text for c in result.choices}) > 1


def test_grpc_n_streams_each_choice_with_its_index_and_one_final_each(stack) -> None:
    sampling = dict(max_tokens=6, temperature=5.0, seed=9, ignore_eos=True)
    with grpc.insecure_channel(stack.settings.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        whole = stub.GenerateUnary(grpc_request(3, **sampling), timeout=60)
        messages = list(stub.Generate(grpc_request(3, **sampling), timeout=60))
    texts, ids = ["", "", ""], [[], [], []]
    for m in messages:
        if m.HasField("delta"):
            texts[m.delta.index] += m.delta.text
            ids[m.delta.index] += m.delta.token_ids
    finals = [m.final for m in messages if m.HasField("final")]
    assert sorted(f.index for f in finals) == [0, 1, 2] and messages[-1].HasField("final")
    assert all(f.finish_reason == common_pb2.FINISH_REASON_LENGTH for f in finals)
    assert all(f.usage.completion_tokens == 6 for f in finals)
    assert texts == [c.text for c in whole.choices]
    assert ids == [list(c.token_ids) for c in whole.choices]


def test_grpc_without_n_gives_one_choice(stack) -> None:
    with grpc.insecure_channel(stack.settings.gateway) as channel:
        result = gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(
            grpc_request(None, max_tokens=2), timeout=60
        )
    assert [c.index for c in result.choices] == [0] and result.choices[0].text == result.text


@pytest.mark.parametrize("n", [0, 17])
def test_grpc_n_outside_1_to_16_is_refused_as_http_refuses_it(stack, n) -> None:
    with grpc.insecure_channel(stack.settings.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for call in (
            stub.GenerateUnary,
            lambda r, timeout: list(stub.Generate(r, timeout=timeout)),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(grpc_request(n, max_tokens=2), timeout=60)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == f"n is {n}; it must be in [1, 16]"
    status, reply = post(stack, "/completions", {"prompt": "Hi", "n": n})
    assert status == 400 and reply["error"]["message"] == f"n is {n}; it must be in [1, 16]"
