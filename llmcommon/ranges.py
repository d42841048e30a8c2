"""The allowed range of each sampling setting, defined once: SamplingParams' checks
(llmcommon/sampling.py), which the gateway's validation, the scheduler's submit checks
and the worker's step checks all run, test a value with these, so that a value one of them
takes is never refused by another (nor the other way round).

A range is what sampling can do, not only what is meaningful: a repetition penalty of 1e-38
divides a seen token's logit into infinity, and the softmax of an infinite logit is NaN, which
failed the worker's whole batch. Pure: no protobuf, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "FREQUENCY_PENALTY",
    "LOGIT_BIAS",
    "MIN_P",
    "PRESENCE_PENALTY",
    "REPETITION_PENALTY",
    "TEMPERATURE",
    "TOP_P",
    "Range",
]


@dataclass(frozen=True, slots=True)
class Range:
    """Finite numbers from `low` to `high`; an open end excludes its bound."""

    name: str
    low: float
    high: float = math.inf
    low_open: bool = False
    note: str = ""  # what a value means, appended to the refusal: "(1 disables it)"

    def contains(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if not math.isfinite(value) or value > self.high:
            return False
        return value > self.low if self.low_open else value >= self.low

    @property
    def spelled(self) -> str:
        """`(0, 1]`, `[0, 2]`, or `a finite number >= 0` for an unbounded one."""
        if math.isinf(self.high):
            return f"a finite number {'>' if self.low_open else '>='} {_number(self.low)}"
        opening = "(" if self.low_open else "["
        return f"in {opening}{_number(self.low)}, {_number(self.high)}]"

    def refusal(self, value: object) -> str:
        """`top_p is 0.0; it must be in (0, 1] (1 disables it)`."""
        note = f" ({self.note})" if self.note else ""
        return f"{self.name} is {value!r}; it must be {self.spelled}{note}"

    def problem(self, value: object) -> str | None:
        """The refusal of `value`, or None when it is in range."""
        return None if self.contains(value) else self.refusal(value)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(value)


TEMPERATURE = Range("temperature", 0.0, note="0 means greedy decoding")
TOP_P = Range("top_p", 0.0, 1.0, low_open=True, note="1 disables it")
MIN_P = Range("min_p", 0.0, 1.0, note="0 disables it")
PRESENCE_PENALTY = Range("presence_penalty", -2.0, 2.0)
FREQUENCY_PENALTY = Range("frequency_penalty", -2.0, 2.0)
# A factor on seen logits: beyond these bounds a logit of the model overflows to infinity (a
# small penalty divides a positive logit by it) and sampling takes NaN; 1 disables it.
REPETITION_PENALTY = Range("repetition_penalty", 1e-4, 1e4, note="1 disables it")
LOGIT_BIAS = Range("logit_bias", -100.0, 100.0, note="each value, added to its token's logit")
