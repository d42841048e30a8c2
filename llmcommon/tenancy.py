"""Who a request belongs to and how it asks to be served, defined once for the gateway (which
sets it from the API key and the request), the scheduler (whose queue orders by it) and the
benchmarks: the tenant and its weight, the request's priority, and its SLO class with that
class's targets. Pure: no protobuf.

Priority follows vLLM: a lower value is served first, ties by arrival; the default is 0. A
tenant's key may cap it (`top_priority`: the lowest value the key may ask for). An SLO class
names a time-to-first-token and a time-per-output-token target (`--slo-classes
interactive=ttft:1,tpot:0.1 batch=ttft:60`); the `deadline` ordering serves first what can still
meet its TTFT target."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = [
    "DEFAULT_TENANT",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "SloClass",
    "Tenancy",
    "TenancyError",
    "parse_slo_classes",
    "priority_problem",
    "valid_name",
]

PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # the wire's sint32
DEFAULT_TENANT = "default"  # the tenant of every request when no keys file names tenants
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class TenancyError(ValueError):
    """A tenancy setting (a class list, a priority, a tenant line) that cannot be taken."""


@dataclass(frozen=True, slots=True)
class SloClass:
    """A service class: its TTFT and TPOT targets in seconds (0 = no target of that kind)."""

    name: str
    ttft_s: float = 0.0
    tpot_s: float = 0.0

    def __str__(self) -> str:
        parts = [f"ttft:{self.ttft_s:g}"] if self.ttft_s else []
        parts += [f"tpot:{self.tpot_s:g}"] if self.tpot_s else []
        return f"{self.name}={','.join(parts)}"


@dataclass(frozen=True, slots=True)
class Tenancy:
    """One request's standing in the queue: set by the gateway, never by the request body
    (the tenant and weight come from the API key)."""

    tenant: str = DEFAULT_TENANT
    weight: float = 1.0  # the tenant's share under `fair` (relative to the others')
    priority: int = 0  # lower first
    slo_class: str = ""  # "" = none
    ttft_s: float = 0.0  # the class's targets (0 = none)
    tpot_s: float = 0.0

    def deadline(self, arrival: float) -> float:
        """When its first token is due (inf without a TTFT target)."""
        return arrival + self.ttft_s if self.ttft_s > 0 else math.inf


def valid_name(name: str) -> bool:
    """A tenant or class name: letters, digits, `_ . -`, up to 64 characters."""
    return bool(_NAME.match(name))


def parse_slo_classes(text: str) -> dict[str, SloClass]:
    """`interactive=ttft:1,tpot:0.1 batch=ttft:60` (space- or `;`-separated classes) as
    name -> class; TenancyError naming what is wrong. An empty text: no classes."""
    classes: dict[str, SloClass] = {}
    for item in re.split(r"[\s;]+", text.strip()):
        if not item:
            continue
        name, sep, spec = item.partition("=")
        if not sep or not valid_name(name):
            raise TenancyError(f"SLO class {item!r}: expected name=ttft:SECONDS,tpot:SECONDS")
        if name in classes:
            raise TenancyError(f"SLO class {name!r} is given twice")
        targets = {"ttft": 0.0, "tpot": 0.0}
        for part in filter(None, spec.split(",")):
            key, colon, value = part.partition(":")
            if key not in targets or not colon:
                raise TenancyError(
                    f"SLO class {name!r}: {part!r} is not ttft:SECONDS or tpot:SECONDS"
                )
            try:
                seconds = float(value)
            except ValueError:
                seconds = math.nan
            if not math.isfinite(seconds) or seconds <= 0:
                raise TenancyError(f"SLO class {name!r}: {key} must be a number > 0, got {value!r}")
            targets[key] = seconds
        if not any(targets.values()):
            raise TenancyError(f"SLO class {name!r} names no target (ttft:S and/or tpot:S)")
        classes[name] = SloClass(name, targets["ttft"], targets["tpot"])
    return classes


def priority_problem(value: object, top: int = PRIORITY_MIN) -> str | None:
    """Why `value` is not a priority a key capped at `top` may ask for, or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"priority must be an integer, got {value!r}"
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        return f"priority must be from {PRIORITY_MIN} to {PRIORITY_MAX}, got {value}"
    if value < top:
        return (
            f"priority {value} is above what this API key may ask for (lower is served first; "
            f"its highest is {top})"
        )
    return None
