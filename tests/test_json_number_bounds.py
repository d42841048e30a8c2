"""A JSON schema's numbers have bounded digits (worker_svc/json_numbers.py): at most 19 before
the point, 17 after it, 3 in the exponent, unless the schema's own numbers need more; the
schema's bounds still hold; where the schema needs a digit the bound refuses, it steps aside.
Each answer is fed token by token through the mask a worker samples from (`allowed_rows`)."""

from __future__ import annotations

import pytest
import torch

from gateway.tokenizer import load_default_tokenizer
from worker_svc.grammar import (
    GrammarCache,
    GrammarState,
    TokenTable,
    allowed_rows,
    model_tokenizer,
    spec_of,
)
from worker_svc.json_numbers import DigitBounds, digit_bounds

VOCAB, EOS = 49152, 2
NUMBER = {"type": "number"}


def field(schema: dict) -> dict:
    """{"x": schema}, as the openai SDK's strict schemas are: required, nothing else."""
    return {
        "type": "object",
        "properties": {"x": schema},
        "required": ["x"],
        "additionalProperties": False,
    }


@pytest.fixture(scope="module")
def grammars() -> GrammarCache:
    cache = GrammarCache(TokenTable(lambda: model_tokenizer("tiny", VOCAB, (EOS,))))
    cache.table.get()
    return cache


def after(grammars: GrammarCache, schema: dict, text: str) -> GrammarState | None:
    """The state after `text`, each token taken only where the mask allows it (None: one was
    refused)."""
    state = grammars.state(spec_of("json_schema", schema), VOCAB)
    for token in load_default_tokenizer().encode(text, add_special_tokens=False):
        if not state.allowed()[token]:
            return None
        state.advance(token)
    return state


def takes(grammars: GrammarCache, schema: dict, value: str) -> bool:
    """Whether {"x": value} is a whole answer under field(schema)."""
    state = after(grammars, field(schema), '{"x": ' + value + "}")
    return state is not None and bool(state.allowed()[EOS])


@pytest.mark.parametrize(
    "value",
    ["0", "3.5", "-12", "-0.25", "6.02e23", "1E-7", "2.5e+300", "1" * 19, "-" + "9" * 19,
     "0." + "3" * 17, "1.5e308"],
)  # fmt: skip
def test_a_number_within_the_bounds_is_taken(grammars, value) -> None:
    assert takes(grammars, NUMBER, value)


@pytest.mark.parametrize(
    "value", ["1" * 40, "3121222222233444444" + "4", "1." + "2" * 18, "1e1234", "-2.5E+1000"]
)
def test_a_number_past_the_bounds_is_refused(grammars, value) -> None:
    assert not takes(grammars, NUMBER, value)


def test_the_runaway_must_end_within_the_bound(grammars) -> None:
    """After 19 digits only what ends or continues a number otherwise is left: no 20th."""
    state = after(grammars, field(NUMBER), '{"x": 3121222222233444444')
    assert state is not None and state.bound is not None
    tokenizer = load_default_tokenizer()
    texts = {tokenizer.decode([t]) for t in state.allowed().nonzero().flatten().tolist()}
    assert {"}", ".", "e", "E"} <= texts
    assert not any(ch.isdigit() for text in texts for ch in text)


def test_an_integer_takes_every_64_bit_value_and_no_more(grammars) -> None:
    integer = {"type": "integer"}
    assert takes(grammars, integer, "9223372036854775807")
    assert takes(grammars, integer, "-9223372036854775807")
    assert takes(grammars, integer, "42")
    assert not takes(grammars, integer, "1" * 20)
    assert not takes(grammars, integer, "1.5")  # the schema's grammar still decides the rest


def test_the_schemas_own_bounds_still_hold(grammars) -> None:
    percent = {"type": "integer", "minimum": 0, "maximum": 100}
    assert takes(grammars, percent, "100") and takes(grammars, percent, "0")
    assert not takes(grammars, percent, "101") and not takes(grammars, percent, "-1")
    share = {"type": "number", "minimum": 0, "maximum": 1}
    assert takes(grammars, share, "0.25") and not takes(grammars, share, "1.5")
    fives = {"type": "integer", "multipleOf": 5}
    assert takes(grammars, fives, "35") and not takes(grammars, fives, "37")
    assert takes(grammars, {"enum": [1.5, 2.5]}, "2.5") and not takes(grammars, NUMBER, "01")


def test_a_schema_that_needs_more_digits_widens_the_bound(grammars) -> None:
    tiny = {"type": "number", "minimum": 1e-21, "maximum": 1}
    assert digit_bounds(field(tiny)) == DigitBounds(fraction=21)
    assert takes(grammars, tiny, "0." + "0" * 20 + "5")
    assert not takes(grammars, tiny, "0." + "0" * 21 + "5")  # 22 decimals: past both


def test_the_bound_steps_aside_where_the_schema_needs_a_digit_it_refuses(grammars) -> None:
    """exclusiveMinimum 0 after `0.` and 17 zeros: only another digit is valid; the mask is the
    schema's alone from there, the same after a recompute (the state rebuilt from tokens)."""
    positive = field({"type": "number", "exclusiveMinimum": 0, "maximum": 1})
    text = '{"x": 0.' + "0" * 17
    tokens = load_default_tokenizer().encode(text + "1}", add_special_tokens=False)
    live = grammars.state(spec_of("json_schema", positive), VOCAB)
    for token in tokens:
        assert live.allowed()[token]
        live.advance(token)
    assert live.bound is None and live.allowed()[EOS]
    again = grammars.state(spec_of("json_schema", positive), VOCAB)
    again.sync(tokens, len(tokens))
    assert again.bound is None and torch.equal(again.allowed(), live.allowed())


def test_only_json_schemas_are_bounded_and_their_bounds_compile_once(grammars) -> None:
    assert grammars.state(spec_of("regex", "[0-9]+"), VOCAB).bound is None
    assert grammars.state(spec_of("choice", '["1234"]'), VOCAB).bound is None
    assert grammars.state(spec_of("json_schema", field(NUMBER)), VOCAB).bound is not None
    known = len(grammars.bounds)
    grammars.state(spec_of("json_schema", {"type": "object"}), VOCAB)
    grammars.state(spec_of("json_schema", field({"type": "integer"})), VOCAB)
    assert DigitBounds() in grammars.bounds and len(grammars.bounds) == known


def test_a_batch_masks_bounded_rows_and_the_rest_apart(grammars) -> None:
    """A bounded row at its 19th digit between regex rows at their 25th and 1st: one bitmask."""
    tokenizer = load_default_tokenizer()
    digit = tokenizer.encode("7", add_special_tokens=False)[0]
    bounded = grammars.state(spec_of("json_schema", field(NUMBER)), VOCAB)
    free, other = (grammars.state(spec_of("regex", "[0-9]+"), VOCAB) for _ in range(2))
    tokens = tokenizer.encode('{"x": ' + "1" * 19, add_special_tokens=False)
    bounded.sync(tokens, len(tokens))
    free.sync([digit] * 25, 25)
    other.sync([digit], 1)
    rows = allowed_rows([free, bounded, other], VOCAB)
    assert rows[0][digit] and rows[2][digit] and not rows[1][digit]
    assert torch.equal(rows[1], bounded.allowed()) and torch.equal(rows[0], free.allowed())


def test_digit_bounds_read_the_schemas_numbers() -> None:
    assert digit_bounds({"type": "number"}) == DigitBounds(19, 17, 3)
    assert digit_bounds({"type": "integer", "maximum": 10**25}).integer == 26
    assert digit_bounds({"multipleOf": 1e-20}).fraction == 20
    nested = {"anyOf": [{"const": {"a": [1.5, 123456789012345678901234]}}, {"enum": [True]}]}
    assert digit_bounds(nested).integer == 24
    named = {"properties": {"minimum": {"type": "string"}, "maximum": {"maximum": 5}}}
    assert digit_bounds(named) == DigitBounds()
    assert digit_bounds({"maximum": float("inf"), "minimum": True}) == DigitBounds()
