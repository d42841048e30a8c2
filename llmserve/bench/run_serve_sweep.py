"""`llmserve bench serve --sweep-token-budgets ... --sweep-time-budgets-ms ...`: the budget sweep
of `bench sim` through real processes. Every budget replays the same arrivals; one table, and
per round the best time budget against the best token budget by goodput.

Without --target each budget (and policy) gets a stack of its own, started and stopped around
its run: every run starts from the same state (a cold step-time model, warmed by a few requests).
With --target the running stack's budgets are set live between runs (`llmserve set`, the admin
key), so its model keeps learning across them, as an operator's stack would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict, replace
from typing import Any

from llmcommon.admin_auth import admin_key
from llmserve import client
from llmserve.bench.budget_sweep import Budget, budgets, verdicts
from llmserve.bench.errors import BenchError
from llmserve.bench.policy import parse_policies
from llmserve.bench.prompts import check_with_tokenizer
from llmserve.bench.records import RunResult
from llmserve.bench.report import Report
from llmserve.bench.run_budget_sweep import print_budget_table, say_row
from llmserve.bench.run_serve import stack_settings, status_options
from llmserve.bench.run_sim import summary_row
from llmserve.bench.served import POLL_S, run_policy, run_workload
from llmserve.bench.workload import Workload

WARMUP = 8  # requests before each run: the step-time model sees the worker before the first row


def run_serve_sweep(args: argparse.Namespace, workload: Workload, command: str) -> int:
    if args.sweep_rounds < 1:
        raise SystemExit("--sweep-rounds: at least 1")
    if args.target and not args.admin_key_file:
        raise SystemExit("a sweep against --target sets its budgets live: give --admin-key-file")
    if args.backend == "openai":
        raise BenchError("the budget sweep sets this project's budgets: --backend openai does "
                         "not apply (use --target for a running stack)")  # fmt: skip
    check_with_tokenizer()
    base = stack_settings(args, workload)
    sweep = budgets(args.sweep_token_budgets or [], args.sweep_time_budgets_ms or [],
                    base.token_budget)  # fmt: skip
    title = f"llmserve bench serve, budget sweep: {workload.name}"
    report = Report(title, workload.describe(), command, slo=args.slo)
    print(f"{title}; prompts: {workload.prompts}", flush=True)
    rows: list[dict[str, Any]] = []
    for round_ in range(1, args.sweep_rounds + 1):
        order = sweep if round_ % 2 else sweep[::-1]
        for budget in order:
            runs = _runs(args, base, budget, workload)
            for policy, result in runs:
                label = budget.label if len(runs) == 1 else f"{policy} {budget.label}"
                result.label = label if args.sweep_rounds == 1 else f"{label}, round {round_}"
                summary = report.add(result)
                row = served_row(round_, budget, summary, result.counters)
                rows.append(row | {"policy": policy})
                say_row(rows[-1], group="round")
    judged = verdicts(rows, by=("round", "policy"))
    out = {
        "command": command,
        "slo": None if args.slo is None else {"ttft_s": args.slo.ttft_s, "tpot_s": args.slo.tpot_s},
        "stack": None if args.target else asdict(base),
        "target": args.target or None,
        "rows": rows,
        "verdicts": judged,
    }
    path = args.out / f"{args.name}-budgets.json"
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    paths = report.write(args.out, args.name)
    print_budget_table(rows, judged, args.slo and args.slo.label, group="round", where="served")
    print("wrote " + ", ".join(str(p) for p in [path, *paths]))
    return 0 if all(r["ok"] == r["requests"] for r in rows) else 1


def _runs(args, base, budget: Budget, workload: Workload) -> list[tuple[str, RunResult]]:
    """(policy label, result) of one budget: on the running stack, or one stack per policy."""
    progress = not args.no_progress
    if args.target:
        set_budget(args.target, args.admin_key_file, budget)
        result = asyncio.run(
            run_workload(args.target, args.status_target, workload, budget.label, progress,
                         args.poll or POLL_S, warmup=WARMUP, timeout_s=args.timeout,
                         **status_options(args))
        )  # fmt: skip
        return [("served", result)]
    settings = replace(
        base, token_budget=budget.token_budget, step_time_budget_ms=budget.time_budget_ms,
        step_time_window=budget.time_window,
    )  # fmt: skip
    out = []
    for policy in parse_policies(args.policies, args.prefix_caching):
        log_dir = args.out / "logs" / args.name / budget.label.replace(" ", "-")
        result = run_policy(settings, policy, workload, log_dir, progress, warmup=WARMUP,
                            poll_s=args.poll or POLL_S, timeout_s=args.timeout)  # fmt: skip
        out.append((policy.label, result))
    return out


def set_budget(target: str, key_file, budget: Budget) -> None:
    """The running stack's budgets, set live (both: a time budget of 0 turns it off)."""
    with client.Client(target, admin_key=admin_key(key_file)) as llm:
        llm.set_settings({"token_budget": str(budget.token_budget),
                          "step_time_budget_ms": f"{budget.time_budget_ms:g}",
                          "step_time_window": str(budget.time_window)})  # fmt: skip


def served_row(
    round_: int, budget: Budget, summary: dict[str, Any], counters: dict[str, Any]
) -> dict[str, Any]:
    errors = counters.get("step_model") or []
    steps = counters.get("executed_steps", 0)
    return summary_row(summary) | {
        "round": round_,
        "budget": budget.label,
        "kind": budget.kind,
        "token_budget": budget.token_budget,
        "time_budget_ms": budget.time_budget_ms,
        "time_window": budget.time_window,
        "steps": steps,
        "step_ms": 1000 * counters.get("forward_seconds", 0.0) / max(1, steps),
        "step_model": errors,  # per worker, over its recent steps as the run ended
        "error_p90": max((e["error_p90"] for e in errors if e["steps"]), default=None),
    }
