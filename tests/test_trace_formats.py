"""Length-only trace CSVs: timestamps (offsets, fractions, numbers), formats, bad rows."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from llmserve.bench.errors import BenchError, TraceError
from llmserve.bench.trace import parse_timestamp, read_trace

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write(tmp_path: Path, text: str, name: str = "t.csv", encoding: str = "utf-8") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding=encoding)
    return path


def arrivals(path: Path, unit: str | None = None) -> list[float]:
    return [r.arrival_s for r in read_trace(path, unit).rows]


def refused(path: Path, unit: str | None = None) -> str:
    with pytest.raises(TraceError) as err:
        read_trace(path, unit)
    return str(err.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2024-05-10T00:00:01.5Z", datetime(2024, 5, 10, 0, 0, 1, 500000, tzinfo=UTC)),
        ("2024-05-10 00:00:00.0097650+00:00", datetime(2024, 5, 10, 0, 0, 0, 9765, tzinfo=UTC)),
        (
            "2023-03-26 03:00:01.25+02:00",
            datetime(2023, 3, 26, 3, 0, 1, 250000, tzinfo=timezone(timedelta(hours=2))),
        ),
        ("2023-11-16 18:15:46", datetime(2023, 11, 16, 18, 15, 46)),
        ("2023-11-16 18:15:46.123456789", datetime(2023, 11, 16, 18, 15, 46, 123456)),
    ],
)
def test_iso_timestamps_keep_their_offsets_and_any_fraction(text, expected) -> None:
    assert parse_timestamp(text) == expected
    assert (parse_timestamp(text).tzinfo is None) == (expected.tzinfo is None)


@pytest.mark.parametrize("text", ["10000101", "11/16/2023 18:15:46", "2023-11-16", "yesterday"])
def test_what_is_not_an_iso_date_and_time_is_refused(text) -> None:
    with pytest.raises(ValueError, match="is not a date and time"):
        parse_timestamp(text)


def test_differences_are_taken_across_offsets(tmp_path) -> None:
    dst = "2023-03-26 01:59:59+01:00,10,1\n2023-03-26 03:00:01.000000+02:00,20,2\n"
    assert arrivals(write(tmp_path, HEADER + dst)) == [0.0, 2.0]
    same = "2024-05-10 02:00:01+02:00,20,2\n2024-05-10 00:00:00Z,10,1\n"
    assert arrivals(write(tmp_path, HEADER + same)) == [0.0, 1.0]
    mixed = "2024-05-10 00:00:00.5+00:00,10,1\n2024-05-10 00:00:01+00:00,20,2\n"
    assert arrivals(write(tmp_path, HEADER + mixed)) == [0.0, 0.5]


def test_rows_with_and_without_an_offset_are_refused(tmp_path) -> None:
    path = write(tmp_path, HEADER + "2024-05-10 00:00:00+00:00,10,1\n2024-05-10 00:00:01,20,2\n")
    assert refused(path) == (
        f"{path}:3: TIMESTAMP '2024-05-10 00:00:01' has no UTC offset, line 2's "
        "'2024-05-10 00:00:00+00:00' has one: give every row an offset, or none"
    )


def test_numeric_timestamps_need_a_unit_and_are_never_dates(tmp_path) -> None:
    path = write(tmp_path, HEADER + "10000101,10,1\n10000615,20,2\n")
    message = refused(path)
    assert message.startswith(f"{path}:2: TIMESTAMP '10000101' is a number: give its unit")
    assert "--timestamp-unit s or ms" in message
    assert arrivals(path, "ms") == pytest.approx([0.0, 0.514])
    assert arrivals(path, "s") == [0.0, 514.0]
    seconds = write(tmp_path, HEADER + "0.0,10,1\n1.5,20,2\n3.25,30,3\n", "s.csv")
    assert arrivals(seconds, "s") == [0.0, 1.5, 3.25]


def test_a_unit_for_date_times_and_a_column_of_both_kinds_are_refused(tmp_path) -> None:
    dates = write(tmp_path, HEADER + "2023-11-16 18:15:46,10,1\n")
    assert "--timestamp-unit s is for numeric timestamps" in refused(dates, "s")
    both = write(tmp_path, HEADER + "1.5,10,1\n2023-11-16 18:15:46,20,2\n", "both.csv")
    assert refused(both, "s") == (
        f"{both}:3: TIMESTAMP: '2023-11-16 18:15:46' is not a number (the column is numeric above)"
    )


def test_a_bom_spaces_after_commas_and_crlf_are_read(tmp_path) -> None:
    text = "TIMESTAMP, ContextTokens, GeneratedTokens\r\n2023-11-16 18:15:46.0, 10, 1\r\n"
    path = write(tmp_path, text + "2023-11-16 18:15:47.0, 20, 2\r\n", encoding="utf-8-sig")
    trace = read_trace(path)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace.rows] == [
        (0.0, 10, 1),
        (1.0, 20, 2),
    ]
    assert trace.format.label == "Azure LLM inference CSV"


def test_burstgpt_is_read_in_seconds(tmp_path) -> None:
    text = (
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "118,GPT-4,417,276,693,Conversation log\n"
    )
    trace = read_trace(write(tmp_path, text))
    assert trace.format.label == "BurstGPT CSV"
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace.rows] == [
        (0.0, 472, 18),
        (113.0, 417, 276),
    ]
    assert trace.skipped_zero == 1  # its failed request (0 response tokens)
    assert trace.describe()["skipped_rows"] == "1 with 0 prompt or output tokens"


def test_an_unknown_header_names_the_formats_accepted(tmp_path) -> None:
    path = write(tmp_path, "timestamp,context_tokens,generated_tokens\n0.0,10,1\n")
    assert refused(path) == (
        f"{path}: unknown header 'timestamp,context_tokens,generated_tokens'; expected "
        "TIMESTAMP,ContextTokens,GeneratedTokens (Azure LLM inference CSV) or "
        "Timestamp,Request tokens,Response tokens (BurstGPT CSV)"
    )
    jsonl = write(tmp_path, '{"timestamp": 0, "input_length": 100, "output_length": 10}\n', "j")
    assert "JSON lines? a trace with hash_ids goes with --workload hash-trace" in refused(jsonl)
    tabs = write(tmp_path, "TIMESTAMP\tContextTokens\tGeneratedTokens\n", "t.tsv")
    assert "the fields must be separated by commas" in refused(tabs)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ("2023-11-16 18:15:47.0,,12\n", ":3: ContextTokens is empty"),
        ("2023-11-16 18:15:47.0,100\n", ":3: 2 fields, the header has 3"),
        ("2023-11-16 18:15:47.0,10,2.5\n", ":3: GeneratedTokens: '2.5' is not a whole number"),
        ("2023-11-16 18:15:47.0,-5,7\n", ":3: ContextTokens: -5 is negative"),
        ("2023-11-16 18:15:47.0,ten,7\n", ":3: ContextTokens: 'ten' is not a whole number"),
        (",10,7\n", ":3: TIMESTAMP is empty"),
    ],
)
def test_a_bad_row_is_named_by_file_line_and_column(tmp_path, rows, message) -> None:
    path = write(tmp_path, HEADER + "2023-11-16 18:15:46.0,374,44\n" + rows)
    assert refused(path).startswith(f"{path}{message}")


def test_integral_floats_are_token_counts_and_zero_rows_are_skipped(tmp_path) -> None:
    text = "2023-11-16 18:15:46.0,374.0,44.0\n2023-11-16 18:15:47.0,0,12\n\n"
    trace = read_trace(write(tmp_path, HEADER + text + "2023-11-16 18:15:48.0,10,0\n"))
    assert [(r.prompt_tokens, r.output_tokens) for r in trace.rows] == [(374, 44)]
    assert trace.skipped_zero == 2


def test_missing_empty_and_header_only_files_are_refused(tmp_path) -> None:
    assert refused(tmp_path / "none.csv") == f"{tmp_path / 'none.csv'}: no such file"
    assert refused(write(tmp_path, "", "e.csv")).endswith("e.csv: empty; expected a header, "
        "TIMESTAMP,ContextTokens,GeneratedTokens (Azure LLM inference CSV) or Timestamp,"
        "Request tokens,Response tokens (BurstGPT CSV)")  # fmt: skip
    assert re.search(r"h\.csv: no requests \(a header and no rows\)$",
                     refused(write(tmp_path, HEADER, "h.csv")))  # fmt: skip


def test_trace_errors_are_bench_errors() -> None:
    assert issubclass(TraceError, BenchError) and issubclass(BenchError, ValueError)


def test_a_gzip_file_is_named_as_gzip(tmp_path) -> None:
    import gzip

    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(HEADER.encode()))
    assert refused(path) == f"{path}: not UTF-8 text (byte 1) (gzip: decompress it first)"


def test_timestamps_whose_span_a_float_cannot_hold_are_refused(tmp_path) -> None:
    path = write(tmp_path, HEADER + "-1e308,5,5\n1e308,5,5\n")
    assert refused(path, "s") == f"{path}: TIMESTAMPs span more seconds than a float holds"


def test_lengths_scale_with_halves_rounded_up(tmp_path) -> None:
    from llmserve.bench.trace import TraceScale, scale_trace

    path = write(tmp_path, HEADER + "0,25,15\n1,45,35\n2,5,5\n")
    rows = scale_trace(read_trace(path, "s").rows, TraceScale(length_scale=0.1))
    assert [(r.prompt_tokens, r.output_tokens) for r in rows] == [(3, 2), (5, 4), (1, 1)]


def test_tenant_traces_take_the_timestamp_unit_and_state_rows_left_out(tmp_path, capsys) -> None:
    from llmserve.bench.workload_args import build_workload
    from llmserve.cli import build_parser

    path = write(tmp_path, HEADER + "3000,5,5\n1000,5,0\n0,6,6\n")

    def tenants(*flags: str):
        argv = ["bench", "sim", "--tenants", f"a:trace={path}", *flags]
        return build_workload(build_parser().parse_args(argv))

    made = tenants("--timestamp-unit", "ms")
    assert [r.arrival_s for r in made.requests] == [0.0, 3.0]
    (a,) = made.params["tenants"]
    assert a["unit"] == "ms" and a["skipped_rows"] == "1 with 0 prompt or output tokens"
    assert "tenant a: trace rows left out: 1 with 0 prompt" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unit must be s or ms"):
        build_workload(build_parser().parse_args(["bench", "sim", "--tenants", "a:unit=h"]))
    spec = f"a:trace={path},unit=s"
    made = build_workload(build_parser().parse_args(["bench", "sim", "--tenants", spec]))
    assert [r.arrival_s for r in made.requests] == [0.0, 3000.0]
