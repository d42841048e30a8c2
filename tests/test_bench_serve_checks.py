"""`bench serve`'s figures (run span, sample counts, failure reasons, the request CSV) and the
checks on its flags: bad values, flags a workload or path cannot apply, --poll and --timeout."""

from __future__ import annotations

import argparse
import csv

import numpy as np
import pytest

from llmserve.bench import run_serve_sweep, served
from llmserve.bench.budget_sweep import Budget, best
from llmserve.bench.errors import BenchError
from llmserve.bench.goodput import Slo
from llmserve.bench.policy import parse_policies
from llmserve.bench.records import RequestRecord, RunResult, StatusSample
from llmserve.bench.report import table, write_requests
from llmserve.bench.run_serve import check_poll_and_timeout
from llmserve.bench.run_serve_sweep import served_row
from llmserve.bench.stats import summarize
from llmserve.bench.workload import fixed
from llmserve.bench.workload_args import build_workload
from llmserve.cli import build_parser
from llmserve.cli import main as llmserve
from llmserve.stack import StackSettings

SLO = Slo(ttft_s=1.0, tpot_s=0.05)
MOONCAKE = [
    '{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}',
    '{"timestamp": 1500, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]}',
    '{"timestamp": 700, "input_length": 300, "output_length": 5, "hash_ids": [3]}',
    '{"timestamp": 30000, "input_length": 200, "output_length": 7, "hash_ids": [4]}',
]


def ok(index: int, at: float, gaps: tuple[float, ...] = (0.01, 0.02)) -> RequestRecord:
    """Scheduled at `at`, first token 17 ms later, then one token after each gap."""
    r = RequestRecord(index, 10, 1 + len(gaps), at, sent_s=at, first_token_s=at + 0.017)
    r.token_gaps, r.completion_tokens = list(gaps), 1 + len(gaps)
    r.end_s = at + 0.017 + sum(gaps)
    return r


def failed(index: int, at: float, error: str = "INVALID_ARGUMENT: too long") -> RequestRecord:
    return RequestRecord(index, 9000, 20, at, sent_s=at, end_s=at + 0.002, error=error)


def early_failures() -> RunResult:
    """The tester's F1 run: four refusals, one a second apart, then one ok request at 4 s."""
    records = [failed(i, float(i)) for i in range(4)] + [ok(4, 4.0)]
    return RunResult("paged", records, [], wall_s=4.05)


def test_rates_are_over_the_span_of_every_request_sent_failed_ones_included() -> None:
    s = summarize(early_failures(), SLO)
    assert s["duration_s"] == pytest.approx(4.047)  # 0 to the ok request's end at 4.047
    assert "ok or failed" in s["duration_basis"]
    assert s["throughput"]["requests_per_s"] == pytest.approx(1 / 4.047)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(3 / 4.047)
    assert s["goodput"]["met"] == 1 and s["goodput_rps"] == pytest.approx(1 / 4.047)


def test_a_sweep_that_fails_early_requests_does_not_win_on_goodput() -> None:
    failing = summarize(early_failures(), SLO)
    steady = summarize(RunResult("x", [ok(i, float(i)) for i in range(5)], [], 4.05), SLO)
    rows = [served_row(1, Budget(64), failing, {}), served_row(1, Budget(512), steady, {})]
    assert best(rows, "tokens")["budget"] == "tokens 512"
    assert rows[0]["goodput_rps"] < 0.25 < rows[1]["goodput_rps"]


def test_percentiles_carry_their_sample_count_and_the_table_shows_it() -> None:
    s = summarize(early_failures(), SLO)
    assert s["ttft_s"]["n"] == 1 and s["itl_s"]["n"] == 2 and s["tpot_s"]["n"] == 1
    assert "ok requests only" in s["percentiles_over"]
    text = render(s)
    assert "TTFT p50/p90/p99 (ok)" in text and "17.0 ms / 17.0 ms / 17.0 ms (n=1)" in text
    assert "Percentiles are over ok requests only" in text


def test_failures_are_counted_by_reason_in_the_json_and_the_table() -> None:
    result = early_failures()
    result.records[0].error = "DEADLINE_EXCEEDED: Deadline Exceeded"
    s = summarize(result)
    assert s["errors_by_reason"] == {"INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 1}
    assert "INVALID_ARGUMENT 3, DEADLINE_EXCEEDED 1" in render(s)


def test_status_rows_say_they_are_sampled_and_how_often() -> None:
    samples = [StatusSample(0.1 * i, 0, i % 3, 1024, 16 * i, 0) for i in range(5)]
    result = RunResult("x", [ok(0, 0.0)], samples, 0.5, sample_period_s=0.1)
    s = summarize(result)
    assert s["kv"]["samples"] == 5 and s["kv"]["sample_period_s"] == 0.1
    text = render(s)
    assert "5, every 0.1 s" in text and "peak running (sampled)" in text


def test_the_request_csv_recomputes_inter_token_times_and_tpot(tmp_path) -> None:
    records = [ok(0, 0.0, (0.01, 0.0, 0.03)), ok(1, 0.5, (0.02,)), failed(2, 1)]
    result = RunResult("x", records, [], 1.0)
    s = summarize(result, SLO)
    rows = list(csv.DictReader(open(write_requests(result, tmp_path / "r.csv"))))
    gaps = [float(g) for r in rows if r["token_gaps_s"] for g in r["token_gaps_s"].split(";")]
    assert float(np.percentile(gaps, 90)) == pytest.approx(s["itl_s"]["p90"])
    assert [r["tpot_s"] for r in rows] == ["0.013333", "0.02", ""]
    assert [r["itl_max_s"] for r in rows] == ["0.03", "0.02", ""]
    assert rows[2]["token_gaps_s"] == "" and rows[2]["error"].startswith("INVALID_ARGUMENT")


def render(summary: dict) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=open("/dev/null", "w"))
    console.print(table("t", [summary]))
    return console.export_text()


def serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", "--baselines", "none", *flags])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--requests", "-2"], "argument --requests: '-2': must be >= 0"),
        (["--concurrency", "-2"], "argument --concurrency: '-2': must be >= 0"),
        (["--max-prompt-tokens", "-5"], "argument --max-prompt-tokens: '-5': must be >= 0"),
        (["--max-output-tokens", "-1"], "argument --max-output-tokens: '-1': must be >= 0"),
        (["--time-scale", "0"], "argument --time-scale: '0': must be > 0"),
        (["--time-scale", "-1"], "argument --time-scale: '-1': must be > 0"),
        (["--length-scale", "0"], "argument --length-scale: '0': must be > 0"),
        (["--duration", "-5"], "argument --duration: '-5': must be >= 0"),
        (["--rate", "0"], "argument --rate: '0': must be > 0"),
        (["--poll", "0"], "argument --poll: '0': must be > 0"),
        (["--timeout", "nan"], "argument --timeout: 'nan' is not a finite number"),
        (["--requests", "2.5"], "argument --requests: '2.5' is not a number (int)"),
    ],
)
def test_bad_values_are_usage_errors(flags, message, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        serve_args(*flags)
    assert done.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_trace_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    bad = tmp_path / "t.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47.0,,12\n")
    with pytest.raises(SystemExit) as done:
        llmserve(["bench", "serve", "--model", "sim", "--workload", "trace", "--trace", str(bad),
                  "--baselines", "none", "--out", str(tmp_path)])  # fmt: skip
    assert done.value.code == 2
    assert capsys.readouterr().err == f"error: llmserve bench: {bad}:2: ContextTokens is empty\n"


def test_a_slice_without_requests_is_refused_naming_the_slice(tmp_path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47,5,12\n")
    with pytest.raises(BenchError) as err:
        build_workload(serve_args("--workload", "trace", "--trace", str(path), "--start", "99"))
    assert str(err.value) == (
        f"no requests in the slice --start 99 --duration 0 (0: to the end) of {path} "
        "(its 1 requests span 0.0 s from its first arrival)"
    )
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47,5,0\n")
    with pytest.raises(BenchError) as err:
        build_workload(serve_args("--workload", "trace", "--trace", str(path)))
    assert str(err.value) == (
        f"no requests in {path}: its rows, 1 with 0 prompt or output tokens, are left out"
    )
    with pytest.raises(BenchError, match="--workload poisson makes no requests"):
        build_workload(serve_args("--workload", "poisson", "--requests", "0"))


def test_a_csv_trace_is_labelled_by_its_file_and_closed_loops_state_no_time_scale(
    tmp_path,
) -> None:
    path = tmp_path / "t.csv"
    rows = "2023-11-16 18:15:46,5,12\n2023-11-16 18:15:48,6,0\n2023-11-16 18:15:49,7,3\n"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    trace = ["--workload", "trace", "--trace", str(path), "--time-scale", "5"]
    open_loop = build_workload(serve_args(*trace, "--concurrency", "0")).params
    assert open_loop["trace"] == str(path)
    assert open_loop["kind"] == "trace (Azure LLM inference CSV)"
    assert open_loop["time_scale"] == 5.0 and open_loop["load_factor"] == 0.2
    assert open_loop["skipped_rows"] == "1 with 0 prompt or output tokens"
    closed = build_workload(serve_args(*trace, "--concurrency", "4")).params
    assert closed["time_scale"].startswith("not applied (closed loop, 4 clients")
    assert "load_factor" not in closed and "span_s" not in closed


def test_hash_traces_apply_the_slice_and_refuse_length_flags(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(MOONCAKE) + "\n")
    base = ["--workload", "hash-trace", "--trace", str(path), "--concurrency", "0"]
    made = build_workload(serve_args(*base, "--start", "0.5", "--duration", "1.5"))
    assert [(r.arrival_s, r.prompt_tokens) for r in made.requests] == [(0.0, 300), (0.8, 1100)]
    assert made.params["trace"] == str(path) and made.params["slice_start_s"] == 0.5
    for flag, value in (("--length-scale", "0.1"), ("--max-prompt-tokens", "64")):
        with pytest.raises(BenchError, match=f"^{flag} does not apply to --workload hash-trace"):
            build_workload(serve_args(*base, flag, value))
    with pytest.raises(BenchError, match="--hash-block-tokens B"):
        build_workload(serve_args(*base, "--length-scale", "0.1"))
    with pytest.raises(BenchError, match=r"^--start does not apply to --workload fixed \(only"):
        build_workload(serve_args("--start", "3"))


def test_poll_and_timeout_are_refused_where_they_cannot_apply() -> None:
    closed = fixed(4, 16, 8, concurrency=2)
    with pytest.raises(BenchError, match="--poll does not apply to --backend openai"):
        check_poll_and_timeout(serve_args("--backend", "openai", "--poll", "0.1"), closed)
    asked = build_parser().parse_args(["bench", "serve", "--timeout", "5"])
    with pytest.raises(BenchError, match="--timeout does not apply to the transformers baselines"):
        check_poll_and_timeout(asked, closed)
    check_poll_and_timeout(serve_args("--timeout", "5", "--poll", "0.1"), closed)  # no baselines


def test_each_stack_started_gets_the_poll_period_and_the_deadline(monkeypatch, tmp_path) -> None:
    seen: list[tuple] = []

    class NoStack:
        def __init__(self, *args) -> None: ...
        def start(self) -> None: ...
        def stop(self) -> None: ...

    async def fake_run(gateway, scheduler, workload, label, progress, poll_s, **kw):
        seen.append((poll_s, kw["timeout_s"], kw["warmup"]))
        return RunResult(label, [], [], 0.0, sample_period_s=poll_s)

    monkeypatch.setattr(served, "Stack", NoStack)
    monkeypatch.setattr(served, "run_workload", fake_run)
    policy = parse_policies("continuous+paged", "")[0]
    served.run_policy(StackSettings(), policy, fixed(1, 4, 4, 1), tmp_path, False,
                      poll_s=0.02, timeout_s=0.5)  # fmt: skip
    monkeypatch.setattr(run_serve_sweep, "run_policy", served.run_policy)
    args = serve_args("--model", "sim", "--poll", "0.03", "--timeout", "2", "--out", str(tmp_path),
                      "--policies", "continuous+paged")  # fmt: skip
    run_serve_sweep._runs(args, StackSettings(), Budget(64), fixed(1, 4, 4, 1))
    assert seen == [(0.02, 0.5, 2), (0.03, 2.0, run_serve_sweep.WARMUP)]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--base-url", "http://h:1/v1"], "--base-url does not apply to --backend grpc"),
        (["--concurrencies", "1,2"], "--concurrencies does not apply to --backend grpc"),
        (["--backend", "openai", "--base-url", "u", "--policies", "continuous+reserve"],
         "--policies does not apply to --backend openai"),
        (["--backend", "openai", "--base-url", "u", "--prefix-caching", "on,off"],
         "--prefix-caching does not apply to --backend openai"),
        (["--backend", "openai", "--base-url", "u", "--target", "h:1"],
         "--target does not apply to --backend openai"),
        (["--target", "127.0.0.1:1", "--policies", "continuous+reserve"],
         "--policies does not apply with --target"),
        (["--target", "127.0.0.1:1", "--prefix-caching", "on"],
         "--prefix-caching does not apply with --target"),
        (["--target", "127.0.0.1:1", "--kv-capacity", "64"],
         "--kv-capacity does not apply with --target"),
        (["--status-target", "127.0.0.1:1"], "--status-target is for a run against --target"),
    ],
)  # fmt: skip
def test_flags_of_the_other_backend_are_refused(flags, message, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        llmserve(["bench", "serve", "--model", "sim", "--baselines", "none", "--requests", "1",
                  "--out", str(tmp_path), *flags])  # fmt: skip
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


def test_an_open_loop_states_its_span_before_the_run() -> None:
    from llmserve.bench.run_serve import planned
    from llmserve.bench.workload import RequestSpec, Workload

    load = Workload("t", [RequestSpec(0, 4, 4, 0.0), RequestSpec(1, 4, 4, 100_000.0)])
    assert planned(load) == "open loop: 2 arrivals over 100,000.0 s (27.78 h)"
