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
* `max_tokens` unset -> `min(default_max_tokens, max_context)`; set -> 1..max_context. The
  prompt's length is known only after tokenizing: it must leave room for one token
  (`llmserve.runtime.request_checks.context_problem`, the scheduler's check too); generation
  stops at the context (finish reason length).
* temperature: finite and >= 0 (0 means greedy); top_p in (0, 1]; top_k >= 0 (0 = disabled).
  The ranges are defined once, for the scheduler and the worker too: llmserve/runtime/ranges.py.
  A temperature below MIN_TEMPERATURE counts as 0, as in vLLM: it is greedy in effect, and logits
  divided by a subnormal temperature overflow to inf, which made the worker's sampling fail for
  the whole batch.
* stop: at most 16 strings, each 1..256 characters.
* size: `InputLimits` checks run first, on counts alone, before anything is built from the request
  (rendering and tokenizing take time and memory in proportion to it). By default the limits are
  what could fit the model's context: a chat message renders to one token at least, and a token
  spells at most `longest_token_chars` characters, so a longer text cannot fit either.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.runtime.ranges import TEMPERATURE, TOP_P, Range

__all__ = [
    "ALLOWED_ROLES",
    "InputLimits",
    "InvalidRequest",
    "MAX_STOP_CHARS",
    "MAX_STOPS",
    "ValidatedParams",
    "validate",
]

MAX_STOPS = 16
MAX_STOP_CHARS = 256
ALLOWED_ROLES = ("system", "user", "assistant", "developer", "tool")

DEFAULT_TEMPERATURE = 1.0
MIN_TEMPERATURE = 1e-5  # below this, greedy
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0


class InvalidRequest(ValueError):
    """The request is malformed; the message says what to change, `param` which field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_range(allowed: Range, value: object, param: str) -> None:
    problem = allowed.problem(value)
    if problem is not None:
        raise InvalidRequest(problem, param)


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


def _check_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if not isinstance(stop, list | tuple):
        raise InvalidRequest("stop must be a list of strings", "stop")
    if len(stop) > MAX_STOPS:
        message = f"stop has {len(stop)} strings; at most {MAX_STOPS} are allowed"
        raise InvalidRequest(message, "stop")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise InvalidRequest(f"stop[{i}] must be a string, not {type(s).__name__}", "stop")
        if not s:
            raise InvalidRequest(f"stop[{i}] is empty; stop strings must be non-empty", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"stop[{i}] is {len(s)} characters long; the limit is {MAX_STOP_CHARS}", "stop"
            )
    return tuple(stop)


def validate(
    prompt: str | None,
    messages: list[tuple[str, str]] | None,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    stop: list[str],
    max_context: int,
    default_max_tokens: int,
) -> ValidatedParams:
    """Check a generate request and resolve its defaults; raise InvalidRequest if it is bad."""
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

    if max_tokens is None:
        resolved_max_tokens = min(default_max_tokens, max_context)
    else:
        if not _is_int(max_tokens):
            kind = type(max_tokens).__name__
            raise InvalidRequest(f"max_tokens must be an integer, not {kind}", "max_tokens")
        if max_tokens <= 0:
            raise InvalidRequest(f"max_tokens is {max_tokens}; it must be at least 1", "max_tokens")
        if max_tokens > max_context:
            raise InvalidRequest(
                f"max_tokens is {max_tokens}; it must be at most the model's context of "
                f"{max_context} tokens",
                "max_tokens",
            )
        resolved_max_tokens = max_tokens

    if temperature is None:
        resolved_temperature = DEFAULT_TEMPERATURE
    else:
        _check_range(TEMPERATURE, temperature, "temperature")
        resolved_temperature = float(temperature) if temperature >= MIN_TEMPERATURE else 0.0

    if top_p is None:
        resolved_top_p = DEFAULT_TOP_P
    else:
        _check_range(TOP_P, top_p, "top_p")
        resolved_top_p = float(top_p)

    if top_k is None:
        resolved_top_k = DEFAULT_TOP_K
    else:
        if not _is_int(top_k):
            raise InvalidRequest(f"top_k must be an integer, not {type(top_k).__name__}", "top_k")
        if top_k < 0:
            raise InvalidRequest(f"top_k is {top_k}; it must be >= 0 (0 disables it)", "top_k")
        resolved_top_k = top_k

    return ValidatedParams(
        prompt=prompt,
        messages=checked_messages,
        max_tokens=resolved_max_tokens,
        temperature=resolved_temperature,
        top_p=resolved_top_p,
        top_k=resolved_top_k,
        stop=_check_stop(stop),
    )
