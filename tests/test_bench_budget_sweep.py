"""The budget sweep of `bench sim`: token budgets against time budgets on the same arrivals,
judged by goodput; the flags that ask for it."""

from __future__ import annotations

import argparse
import json

import pytest

from llmserve.bench.budget_sweep import (
    Budget,
    best,
    budgets,
    positive_list,
    time_budget_list,
    verdicts,
)
from llmserve.bench.run_serve import stack_settings
from llmserve.bench.workload import fixed
from llmserve.cli import build_parser
from llmserve.cli import main as llmserve
from llmserve.stack import Stack


def row(budget: Budget, goodput: float | None, tok_s: float = 100.0, load: float = 1.0,
        itl_p99: float | None = 0.011) -> dict:  # fmt: skip
    return {
        "load": load,
        "policy": "continuous+paged",
        "budget": budget.label,
        "kind": budget.kind,
        "time_budget_ms": budget.time_budget_ms,
        "goodput_rps": goodput,
        "output_tokens_per_s": tok_s,
        "itl_p99_s": itl_p99,
    }


def test_time_budgets_run_under_the_token_cap_after_the_token_budgets() -> None:
    swept = budgets([64, 256], [10.0], cap=8192)
    assert [b.label for b in swept] == ["tokens 64", "tokens 256", "time 10 ms"]
    assert [b.kind for b in swept] == ["tokens", "tokens", "time"]
    assert swept[-1].token_budget == 8192


def test_a_time_budget_may_be_held_over_a_window_of_steps() -> None:
    parsed = time_budget_list("50, 100x4")
    assert parsed == [(50.0, 1), (100.0, 4)]
    swept = budgets([], parsed, cap=1024)
    assert [b.label for b in swept] == ["time 50 ms", "time 100 ms x4"]
    assert [b.time_window for b in swept] == [1, 4]


@pytest.mark.parametrize("text", ["", "100x", "100x0", "100x65", "0x4", "x4", "100y4"])
def test_a_bad_time_budget_list_is_a_usage_error(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        time_budget_list(text)


def test_the_best_of_a_kind_is_by_goodput_then_throughput() -> None:
    rows = [
        row(Budget(64), 2.0, tok_s=500.0),
        row(Budget(256), 3.0, tok_s=100.0),
        row(Budget(512), 3.0, tok_s=200.0),
        row(Budget(8192, 10.0), 9.0),
    ]
    assert best(rows, "tokens")["budget"] == "tokens 512"
    assert best(rows, "time")["budget"] == "time 10 ms"


def test_a_verdict_per_load_compares_the_best_of_each_kind() -> None:
    rows = [
        row(Budget(64), 2.0),
        row(Budget(8192, 10.0), 3.0, itl_p99=0.0105),
        row(Budget(8192, 20.0), 1.0),
        row(Budget(64), 0.0, load=4.0),
        row(Budget(8192, 10.0), 1.0, load=4.0),
    ]
    light, heavy = verdicts(rows)
    assert light["best_token_budget"] == "tokens 64"
    assert light["best_time_budget"] == "time 10 ms"
    assert light["goodput_ratio"] == pytest.approx(1.5)
    assert light["itl_p99_over_budget"] == pytest.approx(1.05)
    assert heavy["goodput_ratio"] is None  # no token budget met the SLO: no ratio to state


@pytest.mark.parametrize("text", ["", "64,x", "64,0", "-5"])
def test_a_bad_budget_list_is_a_usage_error(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        positive_list(int)(text)


def test_bench_sim_sweeps_token_and_time_budgets_into_one_report(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        llmserve(
            ["bench", "sim", "--workload", "poisson", "--requests", "24", "--rate", "50",
             "--prompt-tokens", "200", "--output-tokens", "8", "--policies", "continuous+paged",
             "--sim-workers", "2", "--sweep-token-budgets", "64,512", "--sweep-time-budgets-ms",
             "50", "--slo", "ttft=5,tpot=1", "--out", str(tmp_path), "--no-progress"]
        )  # fmt: skip
    assert done.value.code == 0
    out = json.loads((tmp_path / "sim-budgets.json").read_text())
    assert [r["budget"] for r in out["rows"]] == ["tokens 64", "tokens 512", "time 50 ms"]
    assert all(r["ok"] == 24 for r in out["rows"])
    assert all(r["goodput_rps"] > 0 for r in out["rows"])
    assert out["slo"] == {"ttft_s": 5.0, "tpot_s": 1.0}
    assert len(out["verdicts"]) == 1
    report = json.loads((tmp_path / "sim-budgets-load1.json").read_text())
    assert [r["label"] for r in report["runs"]] == ["tokens 64", "tokens 512", "time 50 ms"]
    assert "goodput_rps" in report["runs"][0]
    assert "token budgets vs time budgets" in capsys.readouterr().out


def test_bench_serve_hands_the_time_budget_to_each_stacks_scheduler(tmp_path) -> None:
    args = build_parser().parse_args(["bench", "serve", "--step-time-budget-ms", "40"])
    settings = stack_settings(args, fixed(4, 16, 8, concurrency=2))
    flags = Stack(settings, tmp_path).commands()["scheduler"]
    assert flags[flags.index("--step-time-budget-ms") + 1] == "40.0"
    assert flags[flags.index("--step-time-window") + 1] == "1"
    args = build_parser().parse_args(["bench", "serve", "--step-time-budget-ms", "40",
                                      "--step-time-window", "4"])  # fmt: skip
    flags = Stack(stack_settings(args, fixed(4, 16, 8, concurrency=2)), tmp_path).commands()
    assert flags["scheduler"][flags["scheduler"].index("--step-time-window") + 1] == "4"
