"""Prefix caching through real processes (tiny model, fp32): requests that share a long prefix
give the same greedy outputs with caching on and off (a repetition penalty covers the cached part
of a prompt too), and only with it on does the scheduler report prompt tokens served from the
cache (status and /metrics)."""

from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest

from llmcommon.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from llmserve import client
from llmserve.ports import free_run
from tests.stacks import running_stack, tiny_settings

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]

SYSTEM = "You are a careful assistant. Answer briefly and cite the rules you follow. " * 4
QUESTIONS = ["What is 2 + 2?", "Name a river.", "Why is the sky blue?", "Say hello."]


def generate(gateway: str, prompt: str) -> list[int]:
    request = client.make_request(prompt=prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    return [t for m in client.stream(gateway, request, timeout=120) for t in m.delta.token_ids]


def run(caching: bool, tmp_path) -> tuple[list[list[int]], dict, str]:
    """The first request alone (it fills the cache), then the others at once, then one whose
    penalty covers its prompt: their outputs, the scheduler's status and its /metrics text."""
    settings = tiny_settings(
        prefix_caching=caching, block_size=4, kv_capacity=2048, metrics_base_port=free_run(3)
    )
    with running_stack(settings, tmp_path) as stack:
        gateway = stack.settings.gateway
        outputs = {0: generate(gateway, SYSTEM + QUESTIONS[0])}

        def one(i: int) -> None:
            outputs[i] = generate(gateway, SYSTEM + QUESTIONS[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(1, len(QUESTIONS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        outputs[len(QUESTIONS)] = penalized(settings.scheduler)
        status = client.status_dict(client.status(settings.scheduler))
        url = f"http://127.0.0.1:{settings.metrics_port(1)}/metrics"
        metrics = urllib.request.urlopen(url, timeout=5).read().decode()
    return [outputs[i] for i in range(len(QUESTIONS) + 1)], status, metrics


def submit(scheduler: str, prompt: list[int], **sampling) -> list[int]:
    request = scheduler_pb2.SubmitRequest(
        prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=3, **sampling)
    )
    with grpc.insecure_channel(scheduler) as channel:
        events = scheduler_pb2_grpc.SchedulerStub(channel).Submit(request, timeout=60)
        return [t for event in events for t in event.token_ids]


def penalized(scheduler: str) -> list[int]:
    """A prompt's first token, pushed up by a logit bias but in the prompt, so that a repetition
    penalty (over the prompt, cached part included) holds it back: the bias alone would win."""
    prompt = [(37 * i) % 3000 + 5 for i in range(40)]  # 10 full blocks of 4
    submit(scheduler, prompt + [11], temperature=0.0)  # caches them
    biased = dict(temperature=0.0, ignore_eos=True, logit_bias={prompt[0]: 100.0})
    out = submit(scheduler, prompt + [12], repetition_penalty=1000.0, **biased)
    assert prompt[0] not in out and submit(scheduler, [13], **biased)[0] == prompt[0]
    return out


def sample(metrics: str, name: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith(name + "{"))
    return float(line.split()[-1])


def test_prefix_caching_changes_no_output_and_reports_its_hits(tmp_path) -> None:
    cached, on, on_metrics = run(True, tmp_path / "on")
    plain, off, off_metrics = run(False, tmp_path / "off")
    assert cached == plain and all(len(out) == 12 for out in cached[: len(QUESTIONS)])
    assert on["prefix_caching"] and not off["prefix_caching"]
    assert on["prompt_tokens"] == off["prompt_tokens"] > 0
    # each text request after the first finds at least 10 blocks of the system prompt cached,
    # and the penalized one its 10 blocks
    assert on["hit_tokens"] >= len(QUESTIONS) * 40 and off["hit_tokens"] == 0
    assert [w["hit_tokens"] for w in on["workers"]] == [on["hit_tokens"]]
    hits = "llmserve_scheduler_prefix_hit_tokens_total"
    assert sample(on_metrics, hits) == on["hit_tokens"] and sample(off_metrics, hits) == 0
    prompts = "llmserve_scheduler_prefix_prompt_tokens_total"
    assert sample(on_metrics, prompts) == on["prompt_tokens"]


def chat_outputs(caching: bool, tmp_path) -> tuple[list[list[int]], dict]:
    """SmolLM2 (fp32): three conversations that share a system prompt, sent at once after a
    first one filled the cache; each asks for 16 greedy tokens."""
    settings = tiny_settings(
        model="smollm2", prefix_caching=caching, kv_capacity=4096, token_budget=128
    )
    system = "You are a helpful assistant for a railway company. " * 12
    questions = ["When does the first train leave?", "Can I bring a bike?", "Is there wifi?"]
    outputs: dict[int, list[int]] = {}

    def ask(i: int) -> None:
        messages = [("system", system), ("user", questions[i % len(questions)])]
        request = client.make_request(messages=messages, max_tokens=16, temperature=0.0)
        stream = client.stream(settings.gateway, request, timeout=300)
        outputs[i] = [t for m in stream for t in m.delta.token_ids]

    with running_stack(settings, tmp_path) as stack:
        ask(0)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(1, 4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        status = client.status_dict(client.status(stack.settings.scheduler))
    return [outputs[i] for i in range(4)], status


def test_the_real_model_gives_the_same_greedy_chat_answers_with_caching_on_and_off(
    tmp_path,
) -> None:
    cached, on = chat_outputs(True, tmp_path / "on")
    plain, off = chat_outputs(False, tmp_path / "off")
    assert cached == plain and all(out for out in cached)
    assert cached[0] == cached[3]  # the same question again: the same answer
    # the system prompt (about 130 tokens: 8 full blocks of 16) found cached 3 times
    assert on["hit_tokens"] >= 3 * 8 * 16 and off["hit_tokens"] == 0
