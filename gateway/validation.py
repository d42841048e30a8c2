"""Validation of a generate request, independent of protobuf and of the tokenizer.

`validate(...)` checks every field a client sends and resolves the defaults; anything wrong raises
`InvalidRequest` with a message that says which field is wrong and what is allowed, so the gateway
can pass it straight to the client (gRPC INVALID_ARGUMENT).

Decisions:
* exactly one of `prompt` / `messages`. A prompt may be whitespace-only (it is valid text for the
  model); only the empty string is refused.
* chat messages: at least one; role is one of system/user/assistant/developer/tool (developer is
  rendered as a system message, tool as the chat template renders tool results: see
  gateway/tokenizer.py); content must be a str and MAY be empty (an empty system or assistant
  turn is legitimate and renders fine).
* every refusal names the field at fault (`InvalidRequest.param`), as the HTTP API's `param`.
* sampling: the request's `SamplingParams` (llmcommon/sampling.py), checked there, the
  same check the scheduler and the worker run (one set of ranges: llmcommon/ranges.py);
  a refusal names the field. `max_tokens` unset -> `min(default_max_tokens, max_context)`;
  set -> 1..max_context (the HTTP API's rule, `fit_context`, resolves it once the prompt is
  counted: GatewayCore). The settings are checked here once; what the gateway does with them
  after trusts them. The prompt's length is known only after tokenizing: it must leave
  room for one token (`llmcommon.request_checks.context_problem`, the scheduler's check
  too); generation stops at the context (finish reason length). A temperature below
  MIN_TEMPERATURE counts as 0, as in vLLM.
* size: `InputLimits` checks run first, on counts alone, before anything is built from the request
  (rendering and tokenizing take time and memory in proportion to it). By default the limits are
  what could fit the model's context: a chat message renders to one token at least, and a token
  spells at most `longest_token_chars` characters, so a longer text cannot fit either.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmcommon.errors import RequestProblem
from llmcommon.sampling import (
    MAX_STOP_CHARS,
    MAX_STOPS,
    MIN_TEMPERATURE,
    InvalidSampling,
    SamplingParams,
)

__all__ = [
    "ALLOWED_ROLES",
    "InputLimits",
    "InvalidRequest",
    "MAX_STOP_CHARS",
    "MAX_STOPS",
    "MIN_TEMPERATURE",
    "ValidatedParams",
    "validate",
]

ALLOWED_ROLES = ("system", "user", "assistant", "developer", "tool")


class InvalidRequest(RequestProblem, ValueError):
    """The request is malformed; the message says what to change, `param` which field."""


@dataclass(frozen=True, slots=True)
class InputLimits:
    """The most messages and characters a request may hold."""

    max_messages: int
    max_chars: int

    @classmethod
    def for_context(
        cls, max_context: int, longest_token_chars: int, max_messages: int = 0, max_chars: int = 0
    ) -> InputLimits:
        """Explicit limits, or (0) what could fit `max_context` tokens: see the module doc."""
        return cls(max_messages or max_context, max_chars or max_context * longest_token_chars)

    def check_messages(self, count: int) -> None:
        if count > self.max_messages:
            raise InvalidRequest(
                f"the chat has {count} messages; the limit is {self.max_messages}: send fewer"
            )

    def check_chars(self, chars: int, chat: bool = False) -> None:
        """`chars`: the characters of the prompt, or of all the chat's message contents."""
        if chars > self.max_chars:
            what = "the chat's messages have" if chat else "the prompt has"
            raise InvalidRequest(
                f"{what} {chars} characters; the limit is {self.max_chars}: send a shorter text"
            )


@dataclass(frozen=True, slots=True)
class ValidatedParams:
    prompt: str | None
    messages: tuple[tuple[str, str], ...] | None
    sampling: SamplingParams  # checked, max_tokens resolved


def _check_messages(messages: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(messages, list | tuple):
        raise InvalidRequest("messages must be a list of (role, content) pairs", "messages")
    if not messages:
        raise InvalidRequest("messages is empty: send at least one message", "messages")
    out: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, list | tuple) or len(message) != 2:
            raise InvalidRequest(f"messages[{i}] must be a (role, content) pair", f"messages[{i}]")
        role, content = message
        if role not in ALLOWED_ROLES:
            raise InvalidRequest(
                f"messages[{i}].role is {role!r}; it must be one of {', '.join(ALLOWED_ROLES)}",
                f"messages[{i}].role",
            )
        if not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a string, not {type(content).__name__}",
                f"messages[{i}].content",
            )
        out.append((role, content))
    return tuple(out)


def validate(
    prompt: str | None,
    messages: list[tuple[str, str]] | None,
    sampling: SamplingParams,
    max_context: int,
    default_max_tokens: int,
    fit_context: bool = False,
) -> ValidatedParams:
    """Check a generate request and resolve its defaults; raise InvalidRequest if it is bad.
    `fit_context`: the HTTP API's rule, max_tokens left to resolve once the prompt is counted."""
    if max_context <= 0 or default_max_tokens <= 0:
        raise ValueError("server misconfigured: max_context and default_max_tokens must be > 0")

    if prompt is None and messages is None:
        raise InvalidRequest("send either prompt or messages; neither was given", "messages")
    if prompt is not None and messages is not None:
        raise InvalidRequest("send either prompt or messages, not both", "prompt")

    checked_messages: tuple[tuple[str, str], ...] | None = None
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidRequest(f"prompt must be a string, not {type(prompt).__name__}", "prompt")
        if prompt == "":
            raise InvalidRequest("prompt is empty; send at least one character", "prompt")
    else:
        checked_messages = _check_messages(messages)

    try:
        if fit_context:
            checked = _unresolved(sampling, max_context)
        else:
            checked = _resolved(sampling, max_context, default_max_tokens)
    except InvalidSampling as err:
        raise InvalidRequest(str(err), err.param) from None
    return ValidatedParams(prompt=prompt, messages=checked_messages, sampling=checked)


def _resolved(sent: SamplingParams, max_context: int, default_max_tokens: int) -> SamplingParams:
    """The gRPC API's rule: max_tokens unset is the default, set it is within the context."""
    checked = sent.checked()
    if checked.max_tokens is None:
        return checked.limited_to(min(default_max_tokens, max_context))
    if checked.max_tokens > max_context:
        raise InvalidSampling(
            f"max_tokens is {checked.max_tokens}; it must be at most the model's context of "
            f"{max_context} tokens",
            "max_tokens",
        )
    return checked


def _unresolved(sent: SamplingParams, max_context: int) -> SamplingParams:
    """The HTTP API's rule: max_tokens is resolved, or refused in vLLM's words, once the prompt
    is counted (gateway/context_fit.py); one beyond the context is refused then, whatever
    min_tokens says."""
    asked = sent.max_tokens
    if isinstance(asked, int) and asked > max_context:
        return replace(replace(sent, max_tokens=None).checked(), max_tokens=asked)
    return sent.checked()
