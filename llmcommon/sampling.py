"""One request's sampling settings, from the gateway's validation to the worker's sampler: one
frozen dataclass, its defaults, its checks (the ranges of llmcommon/ranges.py) and what
the sampler derives from it. The wire form is llmcommon/sampling_wire.py (by name).

Adding a field: a field here (its default is the unset value), its check in `CHECKS`,
the field of the same name in common.proto's SamplingParams, and its OpenAI name in
gateway/openai_requests.py (`Sampling.params`) if the HTTP API takes it (CONTRIBUTING.md).
Pure: no protobuf, no grpc, no torch."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from llmcommon.errors import RequestProblem
from llmcommon.ranges import (
    FREQUENCY_PENALTY,
    LOGIT_BIAS,
    MIN_P,
    PRESENCE_PENALTY,
    REPETITION_PENALTY,
    TEMPERATURE,
    TOP_P,
    Range,
)

__all__ = [
    "CHECKS",
    "GREEDY",
    "MAX_LOGPROBS",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "MIN_TEMPERATURE",
    "Grammar",
    "InvalidSampling",
    "SamplingParams",
    "f32",
]

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit)
MAX_STOPS = 16
MAX_STOP_CHARS = 256
# Below this a temperature counts as 0, as in vLLM: greedy in effect, and logits divided by a
# subnormal temperature overflow to inf, which would fail the worker's sampling for the batch.
MIN_TEMPERATURE = 1e-5
U64_MAX = 2**64 - 1


class InvalidSampling(RequestProblem, ValueError):
    """A setting out of its range; the message says what is allowed, `param` which field."""


@dataclass(frozen=True, slots=True)
class Grammar:
    """Structured output: the text stays inside this grammar (docs/structured-output.md)."""

    kind: int  # common.proto's Grammar.Kind: JSON_SCHEMA 1, REGEX 2, CHOICE 3, LARK 4
    spec: str


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Every field's default is what an unset field means."""

    max_tokens: int | None = None  # None: the gateway's default (it fills it in)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # 1 means off
    top_k: int = 0  # 0 means off
    seed: int | None = None  # None: a fresh random draw each time
    stop: tuple[str, ...] = ()  # stop strings (the gateway matches them)
    ignore_eos: bool = False  # generate exactly max_tokens
    min_p: float = 0.0  # 0 means off
    presence_penalty: float = 0.0  # over generated tokens (OpenAI)
    frequency_penalty: float = 0.0  # over generated tokens (OpenAI)
    repetition_penalty: float = 1.0  # over prompt and generated tokens; 1 means off
    stop_token_ids: tuple[int, ...] = ()  # ids that end the request (on the worker: every one)
    min_tokens: int = 0  # stop_token_ids (and EOS) cannot end it before this many
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # added to the logits
    logprobs: int | None = None  # top alternatives returned with each token; None: no logprobs
    grammar: Grammar | None = None  # structured output; None: free text

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Needs the request's previous tokens."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def needs_history(self) -> bool:
        """Keeps the tokens it processed: for its penalties, or to rebuild its grammar's state
        after a recompute."""
        return self.penalized or self.grammar is not None

    @property
    def shapes_logits(self) -> bool:
        """Changes the logits before temperature: then even a greedy row is not a plain argmax."""
        return self.grammar is not None or self.shapes_beyond_grammar

    @property
    def shapes_beyond_grammar(self) -> bool:
        """Changes the logits by more than a grammar's mask."""
        return (
            bool(self.logit_bias)
            or self.penalized
            or (self.min_tokens > 0 and bool(self.stop_token_ids))
        )

    def problem(self) -> InvalidSampling | None:
        """The first setting out of its range (naming it), or None."""
        for f in fields(self):
            message = CHECKS[f.name](getattr(self, f.name))
            if message is not None:
                return InvalidSampling(message, f.name)
        return self._min_tokens_problem()

    def _min_tokens_problem(self) -> InvalidSampling | None:
        if isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens:
            message = f"min_tokens {self.min_tokens} is more than max_tokens {self.max_tokens}"
            return InvalidSampling(message, "min_tokens")
        return None

    def limited_to(self, max_tokens: int) -> SamplingParams:
        """These settings, checked, with max_tokens resolved by the gateway (its default, or the
        rest of the context: 1 or more); what that leaves to check is min_tokens within it."""
        limited = replace(self, max_tokens=max_tokens)
        invalid = limited._min_tokens_problem()
        if invalid is not None:
            raise invalid
        return limited

    def vocab_problem(self, vocab_size: int) -> str | None:
        """A token id (of logit_bias or stop_token_ids) outside the vocabulary, named with its
        field, or None."""
        for name, ids in (
            ("logit_bias", self.logit_bias),
            ("stop_token_ids", self.stop_token_ids),
        ):
            outside = [i for i in ids if i >= vocab_size]
            if outside:
                return (
                    f"token id {max(outside)} in {name} is outside the vocabulary of "
                    f"{vocab_size} tokens (0 to {vocab_size - 1})"
                )
        return None

    def checked(self) -> SamplingParams:
        """These settings in their canonical form (a temperature below MIN_TEMPERATURE is 0,
        sequences are tuples); InvalidSampling if one is out of its range."""
        invalid = self.problem()
        if invalid is not None:
            raise invalid
        temperature = float(self.temperature) if self.temperature >= MIN_TEMPERATURE else 0.0
        return replace(
            self,
            temperature=temperature,
            stop=tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids),
            logit_bias=dict(self.logit_bias),
        )


GREEDY = SamplingParams(temperature=0.0)  # a work item's default (tests, profiling)


def f32(value: object) -> object:
    """A number as a float field of the wire holds it (float32); anything else as it is."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _as_sent(allowed: Range) -> Callable[[Any], str | None]:
    """A float setting is checked as the wire holds it, so that a value the gateway takes the
    scheduler and the worker take too (1e-4 is below 1e-4 in float32); the refusal quotes it as
    sent."""

    def check(value: Any) -> str | None:
        if allowed.contains(f32(value)):
            return None
        refusal = allowed.refusal(value)
        if isinstance(value, int | float) and allowed.contains(value):  # in range, not as sent
            refusal += f"; the wire's float32 holds {value!r} as {f32(value)!r}"
        return refusal

    return check


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _max_tokens(value: Any) -> str | None:
    if value is None:
        return None
    if not _is_int(value):
        return f"max_tokens must be an integer, not {type(value).__name__}"
    return f"max_tokens is {value}; it must be at least 1" if value <= 0 else None


def _top_k(value: Any) -> str | None:
    if not _is_int(value):
        return f"top_k must be an integer, not {type(value).__name__}"
    return f"top_k is {value}; it must be >= 0 (0 disables it)" if value < 0 else None


def _seed(value: Any) -> str | None:
    if value is None or (_is_int(value) and 0 <= value <= U64_MAX):
        return None
    return f"seed is {value!r}; it must be an integer in [0, 2**64 - 1]"


def _stop(stop: Any) -> str | None:
    if not isinstance(stop, list | tuple):
        return "stop must be a list of strings"
    if len(stop) > MAX_STOPS:
        return f"stop has {len(stop)} strings; at most {MAX_STOPS} are allowed"
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            return f"stop[{i}] must be a string, not {type(s).__name__}"
        if not s:
            return f"stop[{i}] is empty; stop strings must be non-empty"
        if len(s) > MAX_STOP_CHARS:
            return f"stop[{i}] is {len(s)} characters long; the limit is {MAX_STOP_CHARS}"
    return None


def _token_ids(ids: Any) -> str | None:
    if all(_is_int(i) and i >= 0 for i in ids):
        return None
    return "stop_token_ids holds an id that is not a token id (0 or more)"


def _min_tokens(value: Any) -> str | None:
    if _is_int(value) and value >= 0:
        return None
    return f"min_tokens is {value!r}; it must be an integer >= 0"


def _logit_bias(bias: Any) -> str | None:
    if all(LOGIT_BIAS.contains(f32(b)) for b in bias.values()):
        return None
    return f"logit_bias values must be {LOGIT_BIAS.spelled}"


def _logprobs(value: Any) -> str | None:
    if value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
        return None
    return f"logprobs (top alternatives) must be at most {MAX_LOGPROBS}, got {value}"


def _bool(name: str) -> Callable[[Any], str | None]:
    return lambda value: None if isinstance(value, bool) else f"{name} must be true or false"


GRAMMAR_KINDS = {1: "JSON_SCHEMA", 2: "REGEX", 3: "CHOICE", 4: "LARK"}  # common.proto's


def _grammar(value: Grammar | None) -> str | None:
    """A grammar's kind must be one the workers compile (a kind of 0 or 99 had been accepted
    at the scheduler's door and failed at the worker, as an error of the request's run)."""
    if value is None or value.kind in GRAMMAR_KINDS:
        return None
    return f"grammar kind {value.kind} is not one of {', '.join(GRAMMAR_KINDS.values())}"


CHECKS: dict[str, Callable[[Any], str | None]] = {
    "max_tokens": _max_tokens,
    "temperature": _as_sent(TEMPERATURE),
    "top_p": _as_sent(TOP_P),
    "top_k": _top_k,
    "seed": _seed,
    "stop": _stop,
    "ignore_eos": _bool("ignore_eos"),
    "min_p": _as_sent(MIN_P),
    "presence_penalty": _as_sent(PRESENCE_PENALTY),
    "frequency_penalty": _as_sent(FREQUENCY_PENALTY),
    "repetition_penalty": _as_sent(REPETITION_PENALTY),
    "stop_token_ids": _token_ids,
    "min_tokens": _min_tokens,
    "logit_bias": _logit_bias,
    "logprobs": _logprobs,
    "grammar": _grammar,  # its kind here; its spec is compiled (and refused) by the gateway
}  # one per field of SamplingParams (a test checks)
