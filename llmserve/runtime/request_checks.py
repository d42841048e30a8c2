"""Checks of a request where it enters: the gateway (for its clients) and the scheduler (a caller
like any other) apply the same ones. Token ids are checked against the vocabulary by the
scheduler, which knows it."""

from __future__ import annotations

from llmserve.runtime.ranges import LOGIT_BIAS, SAMPLING_RANGES
from llmserve.v1 import common_pb2

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit)
OPTIONAL = frozenset({"temperature", "top_p", "repetition_penalty"})  # proto3 `optional`


def sampling_problem(s: common_pb2.SamplingParams) -> str | None:
    """What is wrong with a request's sampling settings (their ranges: llmserve/runtime/ranges.py),
    or None. An unset temperature, top_p or repetition_penalty is its default."""
    for allowed in SAMPLING_RANGES:
        optional = allowed.name in OPTIONAL
        if optional and not s.HasField(allowed.name):  # type: ignore[arg-type]
            continue
        problem = allowed.problem(getattr(s, allowed.name))
        if problem is not None:
            return problem
    if not all(LOGIT_BIAS.contains(b) for b in s.logit_bias.values()):
        return f"logit_bias values must be {LOGIT_BIAS.spelled}"
    if s.HasField("logprobs") and s.logprobs > MAX_LOGPROBS:
        return f"logprobs (top alternatives) must be at most {MAX_LOGPROBS}, got {s.logprobs}"
    if s.min_tokens > s.max_tokens:
        return f"min_tokens {s.min_tokens} is more than max_tokens {s.max_tokens}"
    return None


def context_problem(prompt_tokens: int, max_context: int) -> str | None:
    """A prompt must leave room for one generated token within the model's context."""
    if prompt_tokens >= max_context:
        return (
            f"prompt of {prompt_tokens} tokens leaves no room to generate within the model's "
            f"context of {max_context} tokens; shorten the prompt"
        )
    return None
