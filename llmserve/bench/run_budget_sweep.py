"""`llmserve bench sim --sweep-token-budgets ... --sweep-time-budgets-ms ...`: every budget on
the same arrivals at each load, one table, and the best time budget against the best token
budget by goodput."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from typing import Any

from llmserve.bench.budget_sweep import Budget, budgets, verdicts
from llmserve.bench.cost_model import DEFAULT_COST_MODEL, CostModel
from llmserve.bench.policy import parse_policies
from llmserve.bench.report import Report
from llmserve.bench.run_sim import sim_row, sim_settings
from llmserve.bench.tenant_report import print_tenant_section, tenant_section
from llmserve.bench.tenant_sim import has_tenants, simulation_for
from llmserve.bench.workload_args import build_workload

COLUMNS = ("load", "policy", "budget", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "out tok/s",
           "goodput req/s", "SLO met", "time_budget stalls", "step ms")  # fmt: skip


def run_budget_sweep(args: argparse.Namespace, command: str) -> int:
    cost = CostModel.load(args.cost_model or DEFAULT_COST_MODEL)
    base = sim_settings(args)
    policies = parse_policies(args.policies, args.prefix_caching, args.queue_policies)
    tokens, times = args.sweep_token_budgets or [], args.sweep_time_budgets_ms or []
    sweep = budgets(tokens, times, base.token_budget)
    rows: list[dict[str, Any]] = []
    for load in [float(x) for x in args.loads.split(",")]:
        workload = build_workload(args, time_scale=args.time_scale / load)
        title = f"budget sweep, load ×{load:g}: {workload.name}"
        report = Report(title, workload.describe(), command, slo=args.slo)
        print(f"{title}; prompts: {workload.prompts}", flush=True)
        for policy in policies:
            for budget in sweep:
                settings = replace(
                    base,
                    token_budget=budget.token_budget,
                    step_time_budget_ms=budget.time_budget_ms,
                    step_time_window=budget.time_window,
                )
                simulation = simulation_for(workload)(settings, policy, cost)
                result = simulation.run(workload, not args.no_progress)
                result.label = _label(budget, policy.label, len(policies))
                summary = report.add(result)
                rows.append(_budget_row(load, policy.label, budget, summary, result.counters))
                say_row(rows[-1])
        if has_tenants(workload):
            report.extra["tenants"] = section = tenant_section(report.results, workload, base)
            print_tenant_section(section, workload.prompts)
        report.write(args.out, f"{args.name}-budgets-load{load:g}")
    judged = verdicts(rows)
    out = {
        "command": command,
        "slo": None if args.slo is None else {"ttft_s": args.slo.ttft_s, "tpot_s": args.slo.tpot_s},
        "simulated_cluster": asdict(base),
        "rows": rows,
        "verdicts": judged,
    }
    path = args.out / f"{args.name}-budgets.json"
    path.write_text(json.dumps(out, indent=1))
    print_budget_table(rows, judged, args.slo and args.slo.label)
    print(f"wrote {path} and the per-load reports in {args.out}/")
    return 0


def _label(budget: Budget, policy: str, policies: int) -> str:
    return budget.label if policies == 1 else f"{policy} {budget.label}"


def _budget_row(
    load: float, policy: str, budget: Budget, summary: dict[str, Any], counters: dict[str, Any]
) -> dict[str, Any]:
    row = sim_row(load, summary, counters)
    return row | {
        "policy": policy,
        "budget": budget.label,
        "kind": budget.kind,
        "token_budget": budget.token_budget,
        "time_budget_ms": budget.time_budget_ms,
        "time_window": budget.time_window,
        "step_model": counters.get("step_model"),  # per worker: prediction error, coefficients
    }


def say_row(r: dict[str, Any], group: str = "load") -> None:
    """One run's line as it ends (group: load, or a served sweep's round)."""
    goodput = "" if r["goodput_rps"] is None else f", goodput {r['goodput_rps']:.2f} req/s"
    error = r.get("error_p90")
    error_text = "" if error is None else f", step-time error p90 {error:.0%}"
    print(
        f"{group} {_group(group, r[group])} {r['policy']} {r['budget']}: {r['ok']}/"
        f"{r['requests']} ok, {r['output_tokens_per_s']:.0f} output tokens/s{goodput}, p99 TTFT "
        f"{r['ttft_p99_s']:.2f} s, p99 inter-token {1000 * (r['itl_p99_s'] or 0):.1f} ms"
        + error_text,
        flush=True,
    )


def print_budget_table(
    rows: list[dict[str, Any]],
    judged: list[dict[str, Any]],
    slo: str | None,
    group: str = "load",
    where: str = "simulated",
) -> None:
    """group: the rows' grouping column, load (a simulated sweep) or round (a served one)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"token budgets vs time budgets ({where}){f'; SLO {slo}' if slo else ''}")
    errors = any(r.get("error_p90") is not None for r in rows)  # served: the model's own error
    for col in (group, *COLUMNS[1:], *(["step-time error p90"] if errors else [])):
        t.add_column(col, justify="right")
    for r in rows:
        error = [] if not errors else ["-" if r["error_p90"] is None else f"{r['error_p90']:.0%}"]
        t.add_row(
            _group(group, r[group]),
            r["policy"],
            r["budget"],
            f"{r['ttft_p50_s']:.2f} s",
            f"{r['ttft_p99_s']:.2f} s",
            _ms(r["itl_p50_s"]),
            _ms(r["itl_p99_s"]),
            f"{r['output_tokens_per_s']:.0f}",
            "-" if r["goodput_rps"] is None else f"{r['goodput_rps']:.2f}",
            "-" if r["slo_met_share"] is None else f"{r['slo_met_share']:.0%}",
            str(r["stalls"].get("time_budget", 0)),
            f"{r['step_ms']:.1f}",
            *error,
        )
    console = Console(width=190)
    console.print(t)
    for v in judged:
        if v["goodput_ratio"] is None:
            continue
        console.print(
            f"{group} {_group(group, v[group])} {v['policy']}: best {v['best_time_budget']} "
            f"{v['best_time_goodput_rps']:.2f} req/s vs best {v['best_token_budget']} "
            f"{v['best_token_goodput_rps']:.2f} req/s = {v['goodput_ratio']:.2f}×; its p99 "
            f"inter-token {v['itl_p99_over_budget']:.2f}× its budget" + _window_note(v)
        )


def _window_note(verdict: dict[str, Any]) -> str:
    window = verdict.get("best_time_window", 1)
    return f" (held over {window} steps: single gaps may reach {window}×)" if window > 1 else ""


def _group(group: str, value: float) -> str:
    return f"×{value:g}" if group == "load" else f"{value:g}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"
