"""Checks of a request where it enters: the gateway (for its clients) and the scheduler (a caller
like any other) apply the same ones. Token ids are checked against the vocabulary by the
scheduler, which knows it."""

from __future__ import annotations

import math

from llmserve.v1 import common_pb2

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit)


def sampling_problem(s: common_pb2.SamplingParams) -> str | None:
    if not (math.isfinite(s.min_p) and 0 <= s.min_p <= 1):
        return f"min_p must be in [0, 1], got {s.min_p}"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not (math.isfinite(value) and -2 <= value <= 2):
            return f"{name} must be in [-2, 2], got {value}"
    rp = s.repetition_penalty
    if s.HasField("repetition_penalty") and not (math.isfinite(rp) and rp > 0):
        return f"repetition_penalty must be a finite number > 0, got {rp}"
    if not all(math.isfinite(b) and -100 <= b <= 100 for b in s.logit_bias.values()):
        return "logit_bias values must be in [-100, 100]"
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
