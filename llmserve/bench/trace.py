"""Length-only request traces (CSV): parse, slice and scale (lengths and time).

Two formats, told apart by the header (names in any case, spaces around them and a UTF-8 BOM
allowed; further columns ignored):

- Azure LLM inference traces: `TIMESTAMP,ContextTokens,GeneratedTokens`, TIMESTAMP an ISO-8601
  date and time (`2023-11-16 18:15:46.6805900`, `2024-05-10T00:00:00.5Z`, `...+02:00`);
- BurstGPT: `Timestamp,...,Request tokens,Response tokens,...`, Timestamp in seconds.

A timestamp column is either all date-times or all numbers. Date-times keep their UTC offsets
(rows with and without one cannot be mixed); numbers need their unit (`unit`, `--timestamp-unit`
s or ms) unless the format defines it (BurstGPT: seconds). Token counts are whole numbers (`374`
or `374.0`); a row with 0 prompt or output tokens (BurstGPT's failed requests) is skipped and
counted; a bad value fails with the file, line and column.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from llmserve.bench.errors import TraceError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO_ROOT / "data" / "traces" / "azure_llm_inference_conv_2023.csv"

ISO_FORMAT = "YYYY-MM-DD HH:MM[:SS[.fraction]] or with a T, optionally ending Z or ±HH:MM"
ISO = re.compile(
    r"(\d{4}-\d{2}-\d{2})[T ](\d{2}:\d{2}(?::\d{2})?)(?:[.,](\d+))?\s*(Z|[+-]\d{2}(?::?\d{2})?)?",
    re.IGNORECASE,
)
NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
UNITS = {"s": 1.0, "ms": 1e-3}


@dataclass(frozen=True, slots=True)
class TraceFormat:
    label: str
    columns: tuple[str, str, str]  # timestamp, prompt tokens, output tokens
    unit: str | None = None  # numeric timestamps' unit when the format defines it

    @property
    def header(self) -> str:
        return ",".join(self.columns)


AZURE = TraceFormat("Azure LLM inference CSV", ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
BURSTGPT = TraceFormat("BurstGPT CSV", ("Timestamp", "Request tokens", "Response tokens"), "s")
FORMATS = (AZURE, BURSTGPT)


@dataclass(frozen=True, slots=True)
class TraceRow:
    arrival_s: float  # seconds since the first row
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Trace:
    """A trace file as read: its rows in arrival order, and what was left out."""

    path: Path
    format: TraceFormat
    rows: list[TraceRow]
    skipped_zero: int = 0  # rows with 0 prompt or output tokens, left out

    def describe(self) -> dict[str, object]:
        """What every report states about the file."""
        out: dict[str, object] = {"trace": str(self.path), "trace_format": self.format.label}
        if self.skipped_zero:
            out["skipped_rows"] = f"{self.skipped_zero} with 0 prompt or output tokens"
        return out


@dataclass(frozen=True, slots=True)
class TraceScale:
    """How a trace is replayed. Every report states these factors."""

    length_scale: float = 1.0  # prompt and output lengths are multiplied by this
    time_scale: float = 1.0  # arrival offsets are multiplied by this (>1: slower arrivals)
    start_s: float = 0.0  # slice of the original trace: rows with start_s <= arrival ...
    duration_s: float = 0.0  # ... < start_s + duration_s (0 = to the end)
    max_requests: int = 0  # 0 = no limit
    max_prompt_tokens: int = 0  # clip scaled prompts (0 = no clip), e.g. to a model's context
    max_output_tokens: int = 0  # clip scaled outputs (0 = no clip)

    def __post_init__(self) -> None:
        if not (self.length_scale > 0 and self.time_scale > 0):
            raise ValueError("length_scale and time_scale must be > 0")
        limits = (self.start_s, self.duration_s, self.max_requests, self.max_prompt_tokens,
                  self.max_output_tokens)  # fmt: skip
        if any(not v >= 0 for v in limits):
            raise ValueError("start, duration and the limits must be >= 0")

    @property
    def load_factor(self) -> float:
        """Arrival rate relative to the original trace."""
        return 1.0 / self.time_scale


def parse_timestamp(text: str) -> datetime:
    """An ISO-8601 date and time -> datetime: fractions of any length (kept to the
    microsecond), `Z` or a ±HH[:MM] offset (an aware datetime); ValueError otherwise."""
    match = ISO.fullmatch(text.strip())
    if not match:
        raise ValueError(f"{text.strip()!r} is not a date and time ({ISO_FORMAT})")
    date, clock, frac, zone = match.groups()
    frac = f".{(frac + '000000')[:6]}" if frac else ""
    zone = "+00:00" if zone and zone.upper() == "Z" else zone or ""
    return datetime.fromisoformat(f"{date} {clock}{frac}{zone}")


def load_trace(path: Path = DEFAULT_TRACE, unit: str | None = None) -> list[TraceRow]:
    return read_trace(path, unit).rows


def read_trace(path: Path = DEFAULT_TRACE, unit: str | None = None) -> Trace:
    """The file's rows, sorted by arrival; TraceError naming the file (and line) otherwise.
    `unit`: s or ms, the unit of numeric timestamps (None: the format's, if it has one)."""
    if unit is not None and unit not in UNITS:
        raise TraceError(f"timestamp unit {unit!r}: s or ms")
    lines = _records(path)
    if not lines:
        raise TraceError(f"{path}: empty; expected a header, {_expected()}")
    fmt, cols = _header(path, lines[0][1])
    body = [(n, row) for n, row in lines[1:] if any(v.strip() for v in row)]
    if not body:
        raise TraceError(f"{path}: no requests (a header and no rows)")
    for n, row in body:
        if len(row) <= max(cols):
            raise TraceError(f"{path}:{n}: {len(row)} fields, the header has {len(lines[0][1])}")
    stamps = [(n, row[cols[0]]) for n, row in body]
    arrivals = _arrivals(path, fmt, stamps, unit)
    rows, skipped = [], 0
    for (n, row), arrival in zip(body, arrivals, strict=True):
        prompt = _tokens(row[cols[1]], f"{path}:{n}: {fmt.columns[1]}")
        output = _tokens(row[cols[2]], f"{path}:{n}: {fmt.columns[2]}")
        if prompt and output:
            rows.append(TraceRow(arrival, prompt, output))
        else:
            skipped += 1
    return Trace(path, fmt, sorted(rows, key=lambda r: r.arrival_s), skipped)


def _records(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, fields) of every CSV record, blank lines included as []."""
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            return [(reader.line_num, row) for row in reader]
    except UnicodeDecodeError as err:
        gzip = " (gzip: decompress it first)" if path.read_bytes()[:2] == b"\x1f\x8b" else ""
        raise TraceError(f"{path}: not UTF-8 text (byte {err.start}){gzip}") from None
    except csv.Error as err:
        raise TraceError(f"{path}: not CSV ({err})") from None


def _header(path: Path, names: list[str]) -> tuple[TraceFormat, tuple[int, int, int]]:
    """The format whose columns the header names, and their positions."""
    where = {name.strip().lower(): i for i, name in reversed(list(enumerate(names)))}
    for fmt in FORMATS:
        if all(c.lower() in where for c in fmt.columns):
            a, b, c = (where[c.lower()] for c in fmt.columns)
            return fmt, (a, b, c)
    first = ",".join(names)
    hint = ""
    if first.lstrip().startswith("{"):
        hint = " (JSON lines? a trace with hash_ids goes with --workload hash-trace)"
    elif "\t" in first or ";" in first:
        hint = " (the fields must be separated by commas)"
    raise TraceError(f"{path}: unknown header {first[:120]!r}{hint}; expected {_expected()}")


def _expected() -> str:
    return " or ".join(f"{f.header} ({f.label})" for f in FORMATS)


def _arrivals(
    path: Path, fmt: TraceFormat, stamps: list[tuple[int, str]], unit: str | None
) -> list[float]:
    """Seconds since the earliest timestamp, per row."""
    column = fmt.columns[0]
    numeric = bool(NUMBER.fullmatch(stamps[0][1].strip()))
    if numeric:
        unit = unit or fmt.unit
        if unit is None:
            raise TraceError(
                f"{path}:{stamps[0][0]}: {column} {stamps[0][1].strip()!r} is a number: give its "
                "unit with --timestamp-unit s or ms (or use date-times, " + ISO_FORMAT + ")"
            )
        values = [_number(text, f"{path}:{n}: {column}") for n, text in stamps]
        arrivals = [(v - min(values)) * UNITS[unit] for v in values]
        if not math.isfinite(max(arrivals)):
            raise TraceError(f"{path}: {column}s span more seconds than a float holds")
        return arrivals
    if unit is not None:
        raise TraceError(
            f"{path}: --timestamp-unit {unit} is for numeric timestamps; {column} holds "
            f"date-times ({stamps[0][1].strip()!r})"
        )
    times = [_datetime(text, f"{path}:{n}: {column}") for n, text in stamps]
    _same_kind(path, column, stamps, times)
    t0 = min(times)
    return [(t - t0).total_seconds() for t in times]


def _datetime(text: str, where: str) -> datetime:
    if not text.strip():
        raise TraceError(f"{where} is empty")
    try:
        return parse_timestamp(text)
    except ValueError as err:
        raise TraceError(f"{where}: {err}") from None


def _same_kind(
    path: Path, column: str, stamps: list[tuple[int, str]], times: list[datetime]
) -> None:
    """Every date-time with a UTC offset, or none (a local time has no place on the line)."""
    (first, first_text), aware = stamps[0], times[0].tzinfo is not None
    for (n, text), t in zip(stamps, times, strict=True):
        if (t.tzinfo is not None) != aware:
            has, other = ("no", "one") if aware else ("a", "none")
            raise TraceError(
                f"{path}:{n}: {column} {text.strip()!r} has {has} UTC offset, line {first}'s "
                f"{first_text.strip()!r} has {other}: give every row an offset, or none"
            )


def _number(text: str, where: str) -> float:
    value = text.strip()
    if not value:
        raise TraceError(f"{where} is empty")
    if not NUMBER.fullmatch(value) or not math.isfinite(float(value)):
        raise TraceError(f"{where}: {value!r} is not a number (the column is numeric above)")
    return float(value)


def _tokens(text: str, where: str) -> int:
    """A token count: a whole number >= 0 (`374` or `374.0`)."""
    value = text.strip()
    if not value:
        raise TraceError(f"{where} is empty")
    number = float(value) if NUMBER.fullmatch(value) else math.nan
    if not math.isfinite(number) or number != int(number):
        raise TraceError(f"{where}: {value!r} is not a whole number of tokens")
    if number < 0:
        raise TraceError(f"{where}: {value} is negative")
    return int(number)


def scale_trace(rows: list[TraceRow], scale: TraceScale) -> list[TraceRow]:
    """Slice, then scale: arrivals start at 0 and are stretched by time_scale; lengths are
    multiplied by length_scale (at least 1 token) and clipped."""
    end = scale.start_s + scale.duration_s if scale.duration_s else float("inf")
    picked = [r for r in rows if scale.start_s <= r.arrival_s < end]
    if scale.max_requests:
        picked = picked[: scale.max_requests]
    if not picked:
        return []
    t0 = picked[0].arrival_s
    return [
        TraceRow(
            (r.arrival_s - t0) * scale.time_scale,
            _scaled(r.prompt_tokens, scale.length_scale, scale.max_prompt_tokens),
            _scaled(r.output_tokens, scale.length_scale, scale.max_output_tokens),
        )
        for r in picked
    ]


def _scaled(tokens: int, factor: float, clip: int) -> int:
    """`tokens` x `factor`, halves rounded up (not to even: traces are full of round numbers),
    at least 1, clipped to `clip` (0: no clip)."""
    n = max(1, math.floor(tokens * factor + 0.5))
    return min(n, clip) if clip else n
