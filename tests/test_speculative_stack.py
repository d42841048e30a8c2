"""Speculative decoding through real processes (gateway, scheduler, worker; the tiny model in
fp32): the answers are those of the same stack without it, greedy and seeded, streamed, and the
scheduler's counters show that drafts were made, verified and kept."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import replace

import grpc
import pytest

from llmcommon.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from llmserve.ports import free_run
from tests.stacks import running_stack, tiny_settings

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hang_guard")]
PROMPTS = [[5, 6, 7, 8, 9] * 6, [17, 42, 99, 7, 250, 3, 88, 12] * 3, list(range(300, 340))]
SAMPLINGS = [
    {"temperature": 0.0},
    {"temperature": 0.8, "top_p": 0.9, "seed": 77},
    {"temperature": 0.0, "frequency_penalty": 0.5, "logprobs": 2},
    {"temperature": 0.0, "logit_bias": {77: 100.0}},  # 77 again and again: a lookup drafts it
]


def generate(settings, prompt: list[int], sampling: dict) -> tuple[list[int], list[float]]:
    """A request's tokens and their logprobs, streamed from the scheduler."""
    request = scheduler_pb2.SubmitRequest(
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=24, ignore_eos=True, **sampling),
    )
    tokens, logprobs = [], []
    with grpc.insecure_channel(settings.scheduler) as channel:
        for event in scheduler_pb2_grpc.SchedulerStub(channel).Submit(request, timeout=120):
            tokens += event.token_ids
            logprobs += [lp.logprob for lp in event.logprobs]
    return tokens, logprobs


def chat(settings, text: str) -> str:
    """A chat answer's text, streamed through the gateway."""
    request = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(
            messages=[gateway_pb2.ChatMessage(role="user", content=text)]
        ),
        sampling=common_pb2.SamplingParams(max_tokens=32, temperature=0.0),
    )
    with grpc.insecure_channel(settings.gateway) as channel:
        replies = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=120)
        return "".join(r.delta.text for r in replies if r.HasField("delta"))


def answers(settings, tmp) -> tuple[list, dict[str, float]]:
    with running_stack(settings, tmp) as stack:
        out = [generate(stack.settings, p, s) for p in PROMPTS for s in SAMPLINGS]
        out.append(chat(stack.settings, "Repeat after me: one two three, one two three, one two"))
        port = stack.settings.metrics_port(1)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    counters = dict(re.findall(r"^\w+?(spec_decode_num_\w+_total) (\S+)$", text.decode(), re.M))
    return out, {k: float(v) for k, v in counters.items()}


def test_answers_with_speculation_are_those_without(tmp_path) -> None:
    base = tiny_settings()
    taken = [base.gateway_port, base.scheduler_port, base.worker_base_port]
    base = replace(base, metrics_base_port=free_run(3, taken))
    plain, _ = answers(base, tmp_path / "off")
    # fixed: how much is drafted must not depend on how fast the host runs the step-time model's
    # steps (auto's exactness is the core's tests'; here the processes' and the wire's)
    on = replace(base, speculative="ngram+suffix", speculative_length="fixed")
    spec, counters = answers(on, tmp_path / "on")
    assert spec[-1] == plain[-1] and plain[-1]
    for (tokens, lps), (want, want_lps) in zip(spec[:-1], plain[:-1], strict=True):
        assert tokens == want and len(tokens) == 24
        assert lps == pytest.approx(want_lps, abs=1e-4)
    assert counters["spec_decode_num_drafts_total"] > 0
    assert counters["spec_decode_num_accepted_tokens_total"] >= 10  # the forced run of 77s
