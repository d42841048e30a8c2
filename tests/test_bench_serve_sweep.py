"""`llmserve bench serve` in sweep mode: token budgets against time budgets on the same arrivals
through real processes, one stack per budget or the budgets set live on a running stack."""

from __future__ import annotations

import json

import pytest

from llmserve import client
from llmserve.cli import main as llmserve
from tests.stacks import running_stack, tiny_settings

KEY = "sweep-admin-key"
WORKLOAD = ["--workload", "poisson", "--requests", "10", "--rate", "40", "--prompt-tokens", "48",
            "--output-tokens", "6", "--baselines", "none", "--no-progress"]  # fmt: skip


def sweep(args: list[str]) -> int:
    with pytest.raises(SystemExit) as done:
        llmserve(["bench", "serve", *WORKLOAD, *args])
    return done.value.code


def test_one_stack_per_budget_every_run_the_same_requests_and_rounds_reversed(tmp_path) -> None:
    code = sweep(["--model", "sim", "--policies", "continuous+paged", "--sweep-token-budgets",
                  "16,256", "--sweep-time-budgets-ms", "40", "--sweep-rounds", "2",
                  "--slo", "ttft=10,tpot=2", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    out = json.loads((tmp_path / "serve-budgets.json").read_text())
    order = ["tokens 16", "tokens 256", "time 40 ms"]
    assert [r["budget"] for r in out["rows"]] == order + order[::-1]
    assert [r["round"] for r in out["rows"]] == [1, 1, 1, 2, 2, 2]
    assert all(r["ok"] == r["requests"] == 10 for r in out["rows"])
    assert all(r["goodput_rps"] > 0 for r in out["rows"])
    assert [v["round"] for v in out["verdicts"]] == [1, 2]
    assert all(v["goodput_ratio"] is not None for v in out["verdicts"])
    timed = [r for r in out["rows"] if r["kind"] == "time"]
    assert all(r["time_budget_ms"] == 40 and r["token_budget"] == 256 for r in timed)  # the cap
    assert all(r["steps"] > 0 and r["step_model"] for r in out["rows"])
    report = json.loads((tmp_path / "serve.json").read_text())
    assert len(report["runs"]) == 6 and report["runs"][0]["label"] == "tokens 16, round 1"


def test_a_running_stack_gets_each_budget_live_and_keeps_the_last(tmp_path) -> None:
    (tmp_path / "admin.key").write_text(KEY + "\n")
    settings = tiny_settings(token_budget=64, admin_key_file=str(tmp_path / "admin.key"))
    with running_stack(settings, tmp_path) as stack:
        code = sweep(["--target", stack.settings.gateway, "--status-target",
                      stack.settings.scheduler, "--admin-key-file", str(tmp_path / "admin.key"),
                      "--token-budget", "128", "--sweep-token-budgets", "32",
                      "--sweep-time-budgets-ms", "25", "--slo", "ttft=10,tpot=2",
                      "--out", str(tmp_path)])  # fmt: skip
        with client.Client(stack.settings.gateway, admin_key=KEY, timeout=30) as admin:
            live = admin.get_settings()
    assert code == 0
    out = json.loads((tmp_path / "serve-budgets.json").read_text())
    assert [r["budget"] for r in out["rows"]] == ["tokens 32", "time 25 ms"]
    assert all(r["ok"] == 10 for r in out["rows"])
    assert out["target"] == stack.settings.gateway and out["stack"] is None
    # the last run's budgets are the stack's now: the time budget under the --token-budget cap
    assert float(live["step_time_budget_ms"]) == 25 and int(live["token_budget"]) == 128


def test_a_live_sweep_without_the_admin_key_is_refused_before_any_request(tmp_path) -> None:
    with pytest.raises(SystemExit, match="--admin-key-file"):
        llmserve(["bench", "serve", *WORKLOAD, "--target", "127.0.0.1:1",
                  "--sweep-token-budgets", "32", "--out", str(tmp_path)])  # fmt: skip
