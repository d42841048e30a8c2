"""gateway.validation: bad requests raise InvalidRequest with a clear message; defaults resolve."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gateway.validation import (
    InputLimits,
    InvalidRequest,
    ValidatedParams,
    check_fits,
    validate,
)

MAX_CONTEXT = 2048
DEFAULT_MAX = 256


def call(**overrides: Any) -> ValidatedParams:
    args: dict[str, Any] = dict(
        prompt="Hello",
        messages=None,
        max_tokens=None,
        temperature=None,
        top_p=None,
        top_k=None,
        stop=[],
        max_context=MAX_CONTEXT,
        default_max_tokens=DEFAULT_MAX,
    )
    args.update(overrides)
    return validate(**args)


def test_defaults_resolve() -> None:
    p = call()
    assert p == ValidatedParams(
        prompt="Hello",
        messages=None,
        max_tokens=DEFAULT_MAX,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        stop=(),
    )


def test_default_max_tokens_capped_by_context() -> None:
    assert call(max_context=100, default_max_tokens=256).max_tokens == 100


def test_explicit_values_kept() -> None:
    p = call(max_tokens=MAX_CONTEXT, temperature=0, top_p=0.5, top_k=40, stop=["\n\n", "User:"])
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (MAX_CONTEXT, 0.0, 0.5, 40)
    assert isinstance(p.temperature, float)
    assert p.stop == ("\n\n", "User:")


def test_whitespace_prompt_is_valid() -> None:
    assert call(prompt="   \n").prompt == "   \n"


def test_messages_ok_and_empty_content_allowed() -> None:
    msgs = [("system", ""), ("user", "hi"), ("assistant", "hello"), ("user", "again")]
    p = call(prompt=None, messages=msgs)
    assert p.prompt is None
    assert p.messages == tuple(msgs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prompt": None}, "neither"),
        ({"messages": [("user", "x")]}, "not both"),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": 5}, "prompt must be a string"),
        ({"prompt": None, "messages": []}, "messages is empty"),
        ({"prompt": None, "messages": [("tool", "x")]}, r"messages\[0\]\.role is 'tool'"),
        ({"prompt": None, "messages": [("user", "a"), ("", "x")]}, r"messages\[1\]\.role"),
        ({"prompt": None, "messages": [("user", None)]}, r"messages\[0\]\.content must be"),
        ({"prompt": None, "messages": [("user",)]}, r"messages\[0\] must be a \(role"),
        ({"max_tokens": 0}, "at least 1"),
        ({"max_tokens": -3}, "at least 1"),
        ({"max_tokens": MAX_CONTEXT + 1}, "at most the model's context of 2048"),
        ({"max_tokens": 1.5}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"temperature": -0.1}, "must be >= 0"),
        ({"temperature": math.nan}, "finite"),
        ({"temperature": math.inf}, "finite"),
        ({"temperature": "hot"}, "finite"),
        ({"top_p": 0.0}, r"\(0, 1\]"),
        ({"top_p": 1.01}, r"\(0, 1\]"),
        ({"top_p": -1}, r"\(0, 1\]"),
        ({"top_p": math.nan}, r"\(0, 1\]"),
        ({"top_p": math.inf}, r"\(0, 1\]"),
        ({"top_k": -1}, "top_k is -1; it must be >= 0"),
        ({"top_k": 2.0}, "top_k must be an integer"),
        ({"stop": ["s"] * 17}, "at most 16"),
        ({"stop": ["ok", ""]}, r"stop\[1\] is empty"),
        ({"stop": ["x" * 257]}, r"stop\[0\] is 257 characters long; the limit is 256"),
        ({"stop": [3]}, r"stop\[0\] must be a string"),
    ],
)
def test_bad_input_raises_clear_message(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        call(**overrides)


def test_boundaries_accepted() -> None:
    call(max_tokens=1)
    call(top_p=1.0)
    call(top_p=1e-9)
    call(stop=["s"] * 16)
    call(stop=["x" * 256])


def test_invalid_request_is_value_error() -> None:
    assert issubclass(InvalidRequest, ValueError)


def test_server_misconfiguration_is_not_a_client_error() -> None:
    with pytest.raises(ValueError) as info:
        call(max_context=0)
    assert not isinstance(info.value, InvalidRequest)


def test_check_fits() -> None:
    check_fits(prompt_tokens=100, max_tokens=100, max_context=200)
    with pytest.raises(InvalidRequest, match="lower max_tokens to at most 100"):
        check_fits(prompt_tokens=100, max_tokens=101, max_context=200)
    with pytest.raises(InvalidRequest, match="shorter than the model's context"):
        check_fits(prompt_tokens=200, max_tokens=1, max_context=200)


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
