"""A bound on the digits of the numbers in a JSON answer (issue 37, item 8).

llguidance writes a JSON Schema's `number` as `-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?`
and an `integer` as `-?(0|[1-9][0-9]*)`: nothing ends a number but the model. A small model
that has written `"population_millions": 3121` can go on writing digits until `max_tokens`
(with `additionalProperties: false` nothing else may follow but `}`, which it never picks), and
the answer does not parse. Its JSON compiler (1.9.1, and its main branch) has no option for a
number's length, and its number lexemes cannot be intersected from outside the schema.

So the worker adds a second, lexical grammar beside a JSON schema's: a regex over the answer's
text (`DigitBounds.regex`) that is any JSON text whose numbers have at most

- 19 digits before the point (every 64-bit integer: 9223372036854775807 has 19),
- 17 after it (a double round-trips through 17 significant digits),
- 3 in the exponent (a double's exponent is at most 308),

and leaves strings, keys and everything else free. Each step's mask is the schema's mask AND
this one (worker_svc/grammar.py). A larger magnitude is still written, with an exponent
(`1.5e30`), wherever the schema allows an exponent.

A schema says otherwise with its own numbers: the bound widens to the longest of its
`minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, `multipleOf` and the numbers in
its `const`s and `enum`s, written out in full as llguidance writes range bounds (`1e25` as 26
digits, `1e-20` as 20 after the point), so every value the schema admits can still be written.
Where the schema's grammar still needs a digit the bound refuses (an `exclusiveMinimum: 0`
after `0.` and 17 zeros), the bound steps aside for the rest of that answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

INTEGER_DIGITS = 19
FRACTION_DIGITS = 17
EXPONENT_DIGITS = 3
BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
VALUE_KEYS = ("const", "enum")  # values, whose numbers the answer may have to write
# a JSON string (escapes as pairs, so an escaped quote does not end it), outside it the JSON
# punctuation and whitespace, the literals; a number ends at one of END
STRING = r'"([^"\\]|\\(?s:.))*"'
OTHER = r"[{}\[\],: \t\n\r]|true|false|null"
END = r"[,\]} \t\n\r]"


@dataclass(frozen=True, slots=True)
class DigitBounds:
    """The most digits a JSON number may have before the point, after it, in the exponent."""

    integer: int = INTEGER_DIGITS
    fraction: int = FRACTION_DIGITS
    exponent: int = EXPONENT_DIGITS

    def number(self) -> str:
        """One number within the bounds (leading zeros left to the schema's grammar)."""
        return (
            rf"-?[0-9]{{1,{self.integer}}}(\.[0-9]{{1,{self.fraction}}})?"
            rf"([eE][+-]?[0-9]{{1,{self.exponent}}})?"
        )

    def regex(self) -> str:
        """JSON text whose numbers keep the bounds. A number is followed by what ends one (or
        ends the text), so two numbers cannot stand for one longer one."""
        number = self.number()
        return f"({STRING}|{OTHER}|{number}{END})*({number})?"

    def widened(self, value: int | float) -> DigitBounds:
        """The bounds, wide enough to write `value` out in full."""
        whole, _, fraction = written(value).partition(".")
        return DigitBounds(
            max(self.integer, len(whole)), max(self.fraction, len(fraction)), self.exponent
        )


def written(value: int | float) -> str:
    """`value` in plain digits, no sign, no exponent (1e25: 26 digits, 1e-20: 20 decimals)."""
    if isinstance(value, int):
        return str(abs(value))
    return format(abs(Decimal(repr(value))), "f")


def digit_bounds(schema: object) -> DigitBounds:
    """The default bounds, widened to the numbers the schema names."""
    bounds = DigitBounds()
    for value in schema_numbers(schema):
        bounds = bounds.widened(value)
    return bounds


def schema_numbers(schema: object) -> list[int | float]:
    """The finite numbers of a schema's numeric keywords and of its consts and enums."""
    found: list[int | float] = []
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in BOUND_KEYS and is_number(value):
                found.append(value)
            elif key in VALUE_KEYS:
                found.extend(numbers_in(value))
            else:
                found.extend(schema_numbers(value))
    elif isinstance(schema, list):
        for item in schema:
            found.extend(schema_numbers(item))
    return found


def numbers_in(value: object) -> list[int | float]:
    """Every number within a JSON value (a const, an enum's list)."""
    if is_number(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [n for item in value for n in numbers_in(item)]
    return []


def is_number(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and value == value  # not NaN
        and abs(value) != float("inf")
    )
