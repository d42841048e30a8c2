"""What a request may generate within the model's context, and vLLM's words when it may not.

On the HTTP API (as vLLM, whose wording litellm and LangChain recognise by "maximum context
length" and the `context_length_exceeded` code) a prompt plus `max_tokens` over the context is
refused rather than cut at the context, and `max_tokens` left out is the rest of the context.
Each message ends with the code in parentheses: the openai SDK (3.x) puts only the message in
the text of its error, which is where LangChain's ChatOpenAI looks for `context_length_exceeded`
(litellm looks for "maximum context length"); vLLM's own words come first, unchanged.
The gRPC API keeps its own rule: `--default-max-tokens`, generation stopping at the context."""

from __future__ import annotations

CONTEXT_CODE = "context_length_exceeded"  # OpenAI's error code, which clients match on


def prompt_overflow(prompt_tokens: int, max_context: int) -> str | None:
    """A prompt that leaves no room for one generated token, in vLLM's words; else None."""
    if prompt_tokens < max_context:
        return None
    return (
        f"This model's maximum context length is {max_context} tokens. However, your request "
        f"has {prompt_tokens} input tokens. Please reduce the length of the input messages. "
        f"({CONTEXT_CODE})"
    )


def completion_overflow(prompt_tokens: int, max_tokens: int, max_context: int) -> str | None:
    """`max_tokens` beyond what the prompt leaves of the context, in vLLM's words; else None."""
    if prompt_tokens + max_tokens <= max_context:
        return None
    return (
        f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
        f"maximum context length is {max_context} tokens and your request has {prompt_tokens} "
        f"input tokens ({max_tokens} > {max_context} - {prompt_tokens}). ({CONTEXT_CODE})"
    )


def completion_budget(prompt_tokens: int, asked: int | None, max_context: int) -> int:
    """The tokens a request that fits may generate: what it asked, or the rest of the context."""
    return max_context - prompt_tokens if asked is None else asked
