"""Goodput: requests meeting both the TTFT and the TPOT target, per second; the --slo flag."""

from __future__ import annotations

import argparse

import pytest

from llmserve.bench.goodput import Slo, goodput, meets, parse_slo, slo_arg, tpot_s
from llmserve.bench.records import RequestRecord, RunResult
from llmserve.bench.report import Report
from llmserve.bench.run_sim import args_from_json, args_to_json
from llmserve.bench.stats import summarize

SLO = Slo(ttft_s=1.0, tpot_s=0.1)


def record(ttft: float, gaps: list[float], error: str = "") -> RequestRecord:
    """Scheduled at 0: first token at `ttft`, then one token after each gap."""
    end = ttft + sum(gaps)
    r = RequestRecord(0, 10, 1 + len(gaps), 0.0, first_token_s=ttft, end_s=end)
    r.token_gaps, r.completion_tokens, r.error = list(gaps), 1 + len(gaps), error
    return r


def test_a_request_within_both_targets_meets_the_slo() -> None:
    assert meets(record(0.5, [0.05, 0.1, 0.12]), SLO)  # TPOT 0.09


def test_a_late_first_token_misses_the_slo_however_fast_the_rest() -> None:
    assert not meets(record(1.01, [0.01, 0.01]), SLO)


def test_tpot_is_the_mean_gap_so_one_slow_gap_can_be_absorbed() -> None:
    assert tpot_s(record(0.2, [0.25, 0.0, 0.0, 0.0, 0.0])) == pytest.approx(0.05)
    assert meets(record(0.2, [0.25, 0.0, 0.0, 0.0, 0.0]), SLO)
    assert not meets(record(0.2, [0.25, 0.01]), SLO)  # TPOT 0.13


def test_a_one_token_answer_has_no_tpot_to_miss() -> None:
    assert tpot_s(record(0.2, [])) is None
    assert meets(record(0.2, []), SLO)


def test_a_failed_request_never_meets_the_slo() -> None:
    assert not meets(record(0.1, [0.01], error="boom"), SLO)


def test_goodput_counts_the_requests_that_meet_both_per_second() -> None:
    records = [record(0.5, [0.05]), record(2.0, [0.05]), record(0.5, [0.5]), record(0.1, [])]
    g = goodput(records, SLO, duration_s=4.0)
    assert (g["met"], g["share"], g["goodput_rps"]) == (2, 0.5, 0.5)


def test_the_summary_and_the_json_report_carry_goodput_rps(tmp_path) -> None:
    result = RunResult("run", [record(0.5, [0.05]), record(3.0, [0.05])], [], 4.0)
    assert "goodput_rps" not in summarize(result)
    summary = Report("t", {}, slo=SLO).add(result)
    # the run lasts from the first scheduled (0) to the last end (3.05 s)
    assert summary["goodput_rps"] == pytest.approx(1 / 3.05)
    assert summary["goodput"]["met"] == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ttft=2,tpot=0.1", Slo(2.0, 0.1)),
        ("tpot=100ms, ttft=1.5s", Slo(1.5, 0.1)),
    ],
)
def test_an_slo_spec_reads_in_seconds_or_milliseconds(text: str, expected: Slo) -> None:
    assert parse_slo(text) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("ttft=2", "tpot missing"),
        ("ttft=2,tpot=0.1,ttft=3", "ttft given twice"),
        ("ttft=2,itl=0.1", "'itl=0.1' is not ttft=S or tpot=S"),
        ("ttft=fast,tpot=0.1", "'fast' is not a number of seconds"),
        ("ttft=0,tpot=0.1", "ttft must be > 0"),
        ("ttft=2,tpot=-1ms", "tpot must be > 0"),
    ],
)
def test_a_bad_slo_spec_is_a_usage_error_naming_the_problem(text: str, says: str, capsys) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slo", type=slo_arg)
    with pytest.raises(SystemExit):
        parser.parse_args(["--slo", text])
    err = capsys.readouterr().err
    assert says in err and "expected ttft=S,tpot=S" in err


def test_the_slo_survives_the_arguments_handed_to_a_baseline_core() -> None:
    args = argparse.Namespace(slo=SLO, loads="1")
    assert args_from_json(args_to_json(args)) == args
