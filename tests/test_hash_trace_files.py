"""Hash-id trace files (Mooncake JSONL) that cannot be replayed: one line naming the file and
line; and a report's JSON, strict JSON whatever its figures."""

from __future__ import annotations

import gzip
import json

import pytest

from llmserve.bench.errors import TraceError
from llmserve.bench.hash_trace import load_hash_trace
from llmserve.bench.records import RunResult
from llmserve.bench.report import Report

ROW = '{"timestamp": %s, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}\n'


def test_a_gzip_or_other_binary_file_is_one_line_naming_it(tmp_path) -> None:
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress((ROW % 0).encode()))
    with pytest.raises(TraceError) as err:
        load_hash_trace(path)
    assert str(err.value) == f"{path}: not UTF-8 text (byte 1) (gzip: decompress it first)"


@pytest.mark.parametrize("stamp", ["NaN", "Infinity", "-Infinity"])
def test_a_timestamp_that_is_not_a_finite_number_is_refused_naming_the_line(
    tmp_path, stamp
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(ROW % 0 + ROW % stamp)
    with pytest.raises(TraceError) as err:
        load_hash_trace(path)
    assert str(err.value).startswith(f"{path}:2: timestamp must be a finite number")


def test_the_report_json_is_strict_json(tmp_path) -> None:
    report = Report("t", {"trace_span_s": float("inf"), "x": [float("nan")]})
    report.add(RunResult("r", [], [], 1.0))
    text = report.write(tmp_path, "t")[0].read_text()
    workload = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert workload["workload"] == {"trace_span_s": None, "x": [None]}
