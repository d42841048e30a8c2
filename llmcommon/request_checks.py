"""Checks of a request where it enters: the gateway (for its clients) and the scheduler (a caller
like any other) apply the same ones. The sampling settings' checks are SamplingParams'
(llmcommon/sampling.py); token ids are checked against the vocabulary by the scheduler,
which knows it."""

from __future__ import annotations

from llmcommon.sampling import MAX_LOGPROBS

__all__ = ["MAX_LOGPROBS", "context_problem"]


def context_problem(prompt_tokens: int, max_context: int) -> str | None:
    """A prompt must leave room for one generated token within the model's context."""
    if prompt_tokens >= max_context:
        return (
            f"prompt of {prompt_tokens} tokens leaves no room to generate within the model's "
            f"context of {max_context} tokens; shorten the prompt"
        )
    return None
