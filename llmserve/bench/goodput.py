"""Goodput (DistServe): the requests per second that meet both latency targets, time to first
token and time per output token after the first (averaged over the request)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from llmserve.bench.records import RequestRecord

SLO_FORMAT = "ttft=S,tpot=S (seconds; or with an ms suffix, e.g. ttft=2,tpot=100ms)"


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        for name, value in (("ttft", self.ttft_s), ("tpot", self.tpot_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value:g}")

    @property
    def label(self) -> str:
        return f"TTFT ≤ {_fmt(self.ttft_s)}, TPOT ≤ {_fmt(self.tpot_s)}"


def parse_slo(text: str) -> Slo:
    """`ttft=S,tpot=S`, both given once; a value in seconds, or milliseconds with `ms`."""
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or key not in ("ttft", "tpot"):
            raise ValueError(f"{part.strip()!r} is not ttft=S or tpot=S")
        if key in values:
            raise ValueError(f"{key} given twice")
        values[key] = _seconds(value)
    missing = [k for k in ("ttft", "tpot") if k not in values]
    if missing:
        raise ValueError(f"{' and '.join(missing)} missing")
    return Slo(values["ttft"], values["tpot"])


def slo_arg(text: str) -> Slo:
    """`parse_slo` for argparse: a bad spec is a usage error that names the format."""
    try:
        return parse_slo(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}; expected {SLO_FORMAT}") from None


def tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first, averaged over the request (None: one token)."""
    return record.tpot_s


def meets(record: RequestRecord, slo: Slo) -> bool:
    """Finished, its first token within the TTFT target, its TPOT within the TPOT target (a
    one-token answer has no TPOT to miss)."""
    if not record.ok or record.ttft_s is None or record.ttft_s > slo.ttft_s:
        return False
    tpot = tpot_s(record)
    return tpot is None or tpot <= slo.tpot_s


def goodput(records: Iterable[RequestRecord], slo: Slo, duration_s: float) -> dict[str, Any]:
    """How many requests meet the SLO, their share of all, and per second of `duration_s`."""
    records = list(records)
    met = sum(1 for r in records if meets(r, slo))
    return {
        "ttft_s": slo.ttft_s,
        "tpot_s": slo.tpot_s,
        "met": met,
        "share": met / len(records) if records else 0.0,
        "goodput_rps": met / duration_s if duration_s > 0 else 0.0,
    }


def _seconds(value: str) -> float:
    scale = 1e-3 if value.endswith("ms") else 1.0
    number = value.removesuffix("ms").removesuffix("s")
    try:
        return float(number) * scale
    except ValueError:
        raise ValueError(f"{value!r} is not a number of seconds") from None


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:g} ms" if seconds < 1 else f"{seconds:g} s"
