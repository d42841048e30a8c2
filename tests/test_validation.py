"""gateway.validation: bad requests raise InvalidRequest with a clear message; defaults resolve."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gateway.validation import (
    MIN_TEMPERATURE,
    InputLimits,
    InvalidRequest,
    ValidatedParams,
    validate,
)
from llmcommon.sampling import SamplingParams

MAX_CONTEXT = 2048
DEFAULT_MAX = 256


REQUEST = ("prompt", "messages", "max_context", "default_max_tokens", "fit_context")


def call(**overrides: Any) -> ValidatedParams:
    """The request's own fields and the server's; the rest are sampling settings, as sent."""
    args: dict[str, Any] = dict(
        prompt="Hello", messages=None, max_context=MAX_CONTEXT, default_max_tokens=DEFAULT_MAX
    )
    args.update({k: v for k, v in overrides.items() if k in REQUEST})
    sent = {k: v for k, v in overrides.items() if k not in REQUEST}
    return validate(**args, sampling=SamplingParams(**sent))


def test_defaults_resolve() -> None:
    p = call()
    assert p == ValidatedParams(
        prompt="Hello",
        messages=None,
        sampling=SamplingParams(
            max_tokens=DEFAULT_MAX, temperature=1.0, top_p=1.0, top_k=0, stop=()
        ),
    )


def test_default_max_tokens_capped_by_context() -> None:
    assert call(max_context=100, default_max_tokens=256).sampling.max_tokens == 100


def test_explicit_values_kept() -> None:
    p = call(max_tokens=MAX_CONTEXT, temperature=0.7, top_p=0.5, top_k=40, stop=["\n\n", "U:"])
    s = p.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k) == (MAX_CONTEXT, 0.7, 0.5, 40)
    assert s.stop == ("\n\n", "U:")
    assert call(top_k=0).sampling.top_k == 0  # 0 disables top-k: valid


@pytest.mark.parametrize(
    ("given", "resolved"),
    [(0, 0), (1e-45, 0), (MIN_TEMPERATURE / 2, 0), (MIN_TEMPERATURE, MIN_TEMPERATURE), (2, 2)],
)
def test_a_temperature_below_the_minimum_is_greedy_and_the_rest_is_kept(given, resolved) -> None:
    assert call(temperature=given).sampling.temperature == resolved


def test_whitespace_prompt_is_valid() -> None:
    assert call(prompt="   \n").prompt == "   \n"


def test_messages_ok_and_empty_content_allowed() -> None:
    msgs = [("system", ""), ("user", "hi"), ("assistant", "hello"), ("user", "again")]
    p = call(prompt=None, messages=msgs)
    assert p.prompt is None
    assert p.messages == tuple(msgs)


ROLES = "system, user, assistant, developer, tool"
A_TEMPERATURE = "a finite number >= 0 (0 means greedy decoding)"
BAD = [
    ({"prompt": None}, "send either prompt or messages; neither was given"),
    ({"messages": [("user", "x")]}, "send either prompt or messages, not both"),
    ({"prompt": ""}, "prompt is empty; send at least one character"),
    ({"prompt": 5}, "prompt must be a string, not int"),
    ({"prompt": None, "messages": "hi"}, "messages must be a list of (role, content) pairs"),
    ({"prompt": None, "messages": []}, "messages is empty: send at least one message"),
    (
        {"prompt": None, "messages": [("wizard", "x")]},
        f"messages[0].role is 'wizard'; it must be one of {ROLES}",
    ),
    (
        {"prompt": None, "messages": [("user", "a"), ("", "x")]},
        f"messages[1].role is ''; it must be one of {ROLES}",
    ),
    (
        {"prompt": None, "messages": [("user", "a"), ("user", 5)]},
        "messages[1].content must be a string, not int",
    ),
    ({"prompt": None, "messages": [("user",)]}, "messages[0] must be a (role, content) pair"),
    ({"prompt": None, "messages": ["ab"]}, "messages[0] must be a (role, content) pair"),
    ({"max_tokens": 0}, "max_tokens is 0; it must be at least 1"),
    ({"max_tokens": -3}, "max_tokens is -3; it must be at least 1"),
    (
        {"max_tokens": MAX_CONTEXT + 1},
        "max_tokens is 2049; it must be at most the model's context of 2048 tokens",
    ),
    ({"max_tokens": 1.5}, "max_tokens must be an integer, not float"),
    ({"max_tokens": True}, "max_tokens must be an integer, not bool"),
    ({"temperature": -0.1}, f"temperature is -0.1; it must be {A_TEMPERATURE}"),
    ({"temperature": math.nan}, f"temperature is nan; it must be {A_TEMPERATURE}"),
    ({"temperature": math.inf}, f"temperature is inf; it must be {A_TEMPERATURE}"),
    ({"temperature": "hot"}, f"temperature is 'hot'; it must be {A_TEMPERATURE}"),
    ({"temperature": True}, f"temperature is True; it must be {A_TEMPERATURE}"),
    ({"top_p": 0.0}, "top_p is 0.0; it must be in (0, 1] (1 disables it)"),
    ({"top_p": 1.01}, "top_p is 1.01; it must be in (0, 1] (1 disables it)"),
    ({"top_p": -1}, "top_p is -1; it must be in (0, 1] (1 disables it)"),
    ({"top_p": math.nan}, "top_p is nan; it must be in (0, 1] (1 disables it)"),
    ({"top_p": math.inf}, "top_p is inf; it must be in (0, 1] (1 disables it)"),
    ({"top_p": "high"}, "top_p is 'high'; it must be in (0, 1] (1 disables it)"),
    ({"top_k": -1}, "top_k is -1; it must be >= 0 (0 disables it)"),
    ({"top_k": 2.0}, "top_k must be an integer, not float"),
    ({"stop": "\n"}, "stop must be a list of strings"),
    ({"stop": ["s"] * 17}, "stop has 17 strings; at most 16 are allowed"),
    ({"stop": ["ok", ""]}, "stop[1] is empty; stop strings must be non-empty"),
    ({"stop": ["x" * 257]}, "stop[0] is 257 characters long; the limit is 256"),
    ({"stop": ["ok", 3]}, "stop[1] must be a string, not int"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD)
def test_bad_input_raises_a_message_that_names_the_field_and_the_rule(
    overrides: dict[str, Any], message: str
) -> None:
    """The message goes to the client as it is: it is checked whole."""
    with pytest.raises(InvalidRequest) as err:
        call(**overrides)
    assert str(err.value) == message


def test_boundaries_accepted() -> None:
    call(max_tokens=1)
    call(top_p=1.0)
    call(top_p=1e-9)
    call(stop=["s"] * 16)
    call(stop=["x" * 256])


def test_invalid_request_is_value_error() -> None:
    assert issubclass(InvalidRequest, ValueError)


@pytest.mark.parametrize("setting", ["max_context", "default_max_tokens"])
def test_server_misconfiguration_is_not_a_client_error(setting) -> None:
    with pytest.raises(ValueError) as info:
        call(**{setting: 0})
    assert type(info.value) is ValueError  # never sent to the client as INVALID_ARGUMENT
    assert str(info.value) == (
        "server misconfigured: max_context and default_max_tokens must be > 0"
    )


def test_the_smallest_server_settings_are_valid() -> None:
    assert call(max_context=1, default_max_tokens=1).sampling.max_tokens == 1


def test_size_limits_default_to_what_could_fit_the_context() -> None:
    limits = InputLimits.for_context(max_context=2048, longest_token_chars=81)
    assert limits == InputLimits(max_messages=2048, max_chars=2048 * 81)
    explicit = InputLimits.for_context(2048, 81, max_messages=10, max_chars=500)
    assert explicit == InputLimits(max_messages=10, max_chars=500)


def test_size_limits_refuse_past_them_and_say_the_limit() -> None:
    limits = InputLimits(max_messages=4, max_chars=100)
    limits.check_messages(4)
    limits.check_chars(100)
    with pytest.raises(InvalidRequest, match="the chat has 5 messages; the limit is 4"):
        limits.check_messages(5)
    with pytest.raises(InvalidRequest, match="the prompt has 101 characters; the limit is 100"):
        limits.check_chars(101)
    with pytest.raises(InvalidRequest, match="the chat's messages have 101 characters"):
        limits.check_chars(101, chat=True)


def test_min_tokens_is_held_within_the_default_max_tokens() -> None:
    assert call(min_tokens=DEFAULT_MAX).sampling.max_tokens == DEFAULT_MAX
    with pytest.raises(InvalidRequest) as info:
        call(min_tokens=DEFAULT_MAX + 1)
    assert info.value.param == "min_tokens"
    assert str(info.value) == f"min_tokens {DEFAULT_MAX + 1} is more than max_tokens {DEFAULT_MAX}"


def test_under_the_http_rule_max_tokens_waits_for_the_prompt_to_be_counted() -> None:
    """fit_context: unset stays unset (the rest of the context, once the prompt is counted), set
    beyond the context is kept for the context check to refuse in vLLM's words, even with a
    min_tokens above it; within the context min_tokens is held within it here."""
    assert call(fit_context=True, min_tokens=DEFAULT_MAX + 1).sampling.max_tokens is None
    beyond = call(fit_context=True, max_tokens=MAX_CONTEXT + 1, min_tokens=MAX_CONTEXT + 2)
    assert beyond.sampling.max_tokens == MAX_CONTEXT + 1
    with pytest.raises(InvalidRequest) as info:
        call(fit_context=True, max_tokens=4, min_tokens=5)
    assert info.value.param == "min_tokens"
    with pytest.raises(InvalidRequest) as info:
        call(fit_context=True, max_tokens=0)
    assert str(info.value) == "max_tokens is 0; it must be at least 1"
