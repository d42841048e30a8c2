"""`llmserve bench sim`: the trace through the real core on a virtual clock, per policy and load."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from llmserve.bench.caching import caching_pairs, print_caching
from llmserve.bench.cost_model import DEFAULT_COST_MODEL, CostModel
from llmserve.bench.goodput import Slo
from llmserve.bench.plots import write_plots
from llmserve.bench.policy import parse_policies
from llmserve.bench.report import Report, print_table
from llmserve.bench.run_cells import run_cells
from llmserve.bench.simulate import SimSettings, Simulation
from llmserve.bench.sweep_plot import write_sweep_plot
from llmserve.bench.tenant_report import print_tenant_section, tenant_section
from llmserve.bench.tenant_sim import has_tenants, simulation_for
from llmserve.bench.workload_args import build_workload


def run_sim(args: argparse.Namespace, command: str) -> int:
    settings = sim_settings(args)
    if getattr(args, "cells", 0):
        return run_cells(args, command, settings)
    cost = CostModel.load(args.cost_model or DEFAULT_COST_MODEL)
    policies = parse_policies(args.policies, args.prefix_caching, args.queue_policies)
    rows: list[dict[str, Any]] = []
    for load in [float(x) for x in args.loads.split(",")]:
        workload = build_workload(args, time_scale=args.time_scale / load)
        described = workload.describe() | {
            "simulated_cluster": asdict(settings),
            "cost_model": {k: v for k, v in asdict(cost).items() if k != "meta"},
            "cost_model_source": str(args.cost_model or DEFAULT_COST_MODEL),
            "cost_model_measured_on": cost.meta.get("machine", {}).get("processor", "?"),
        }
        report = Report(
            f"simulated ({settings.workers} workers, speedup {settings.speedup:g}): "
            f"{workload.name}",
            described,
            command,
            slo=args.slo,
        )
        for policy in policies:
            simulation = simulation_for(workload)(settings, policy, cost)
            result = simulation.run(workload, not args.no_progress)
            summary = report.add(result)
            rows.append(sim_row(load, summary, result.counters))
            print(
                f"load ×{load:g} {policy.label}: {summary['ok']}/{summary['requests']} ok, "
                f"{summary['throughput']['output_tokens_per_s']:.0f} output tokens/s, "
                f"p99 TTFT {summary['ttft_s']['p99']:.2f} s; simulated in "
                f"{result.counters['real_s']:.0f} s real "
                f"({result.counters['core_us_per_step']:.0f} µs core per step)",
                flush=True,
            )
        name = f"{args.name}-load{load:g}"
        summaries = report.summaries()
        notes = [
            f"times are virtual seconds: cost model {described['cost_model_source']} "
            f"divided by speedup {settings.speedup:g}",
            f"prompts: {workload.prompts}",
            f"workload: {workload.describe()}",
        ]
        print_table(report.title, summaries, None, notes)
        report.extra["notes"] = notes
        report.extra["prefix_caching"] = pairs = caching_pairs(summaries)
        print_caching(pairs, workload.params.get("trace_reuse"))
        if has_tenants(workload):
            report.extra["tenants"] = section = tenant_section(report.results, workload, settings)
            print_tenant_section(section, workload.prompts)
        report.write(args.out, name)
        write_plots(
            args.out, name, summaries, report.results, f"{workload.name}, load ×{load:g}, simulated"
        )
    best = at_slo(rows, args.ttft_slo)
    baseline = None
    if getattr(args, "baseline_rev", ""):
        baseline = baseline_core(args, args.baseline_rev)
        print_core_side_by_side(rows, baseline, args.baseline_rev)
    sweep = {
        "command": command,
        "ttft_slo_s": args.ttft_slo,
        "rows": rows,
        "at_slo": best,
        "at_slo_ratios": slo_ratios(best),
        "reserve_vs_paged": reserve_vs_paged(rows),
        "baseline_core": {"rev": args.baseline_rev, "rows": baseline} if baseline else None,
    }
    path = args.out / f"{args.name}-sweep.json"
    path.write_text(json.dumps(sweep, indent=1))
    write_sweep_plot(rows, args.out / f"{args.name}-sweep.png", args.ttft_slo)
    _print_sweep(sweep)
    print(f"wrote {path} and the per-load reports in {args.out}/")
    return 0


def sim_row(load: float, s: dict[str, Any], counters: dict[str, Any]) -> dict[str, Any]:
    sim = {
        "virtual_s": counters["virtual_s"],
        "real_s": counters["real_s"],
        "core_us_per_step": counters["core_us_per_step"],
        "core_us_median": counters["core_us_median"],
        "core_us_median_full": counters["core_us_median_full"],
        "steps": counters["steps"],
        "step_ms": 1000 * counters["busy_s"] / max(1, counters["steps"]),
    }
    return {"load": load} | summary_row(s) | sim


def summary_row(s: dict[str, Any]) -> dict[str, Any]:
    """A run's summary (Report.add) as one flat row: a simulated run's or a served one's."""
    return {
        "policy": s["label"],
        "requests": s["requests"],
        "ok": s["ok"],
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
        "requests_per_s": s["throughput"]["requests_per_s"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "itl_p50_s": (s["itl_s"] or {}).get("p50"),
        "itl_p99_s": (s["itl_s"] or {}).get("p99"),
        "goodput_rps": s.get("goodput_rps"),
        "slo_met_share": (s.get("goodput") or {}).get("share"),
        "e2e_p99_s": s["e2e_s"]["p99"],
        "queue_p99_s": (s["queue_s"] or {}).get("p99"),
        "preemptions": s["preemptions"],
        "kv_mean_written_share": (s["kv"] or {}).get("mean_written_share"),
        "kv_mean_held_share": (s["kv"] or {}).get("mean_held_share"),
        "peak_running": (s["kv"] or {}).get("peak_running"),
        "stalls": s["stalls"],
    }


def at_slo(rows: list[dict[str, Any]], slo: float) -> dict[str, dict[str, Any] | None]:
    """Per policy: the highest-throughput load whose p99 TTFT meets the target."""
    out: dict[str, dict[str, Any] | None] = {}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        meeting = [r for r in rows if r["policy"] == policy and r["ttft_p99_s"] <= slo]
        best = max(meeting, key=lambda r: r["output_tokens_per_s"], default=None)
        out[policy] = (
            None
            if best is None
            else {
                "load": best["load"],
                "output_tokens_per_s": best["output_tokens_per_s"],
                "ttft_p99_s": best["ttft_p99_s"],
            }
        )
    return out


def slo_ratios(best: dict[str, dict[str, Any] | None]) -> dict[str, float | None]:
    """continuous+paged's throughput at the p99 TTFT target over each other policy's."""
    paged = best.get("continuous+paged")
    return {
        f"continuous+paged / {policy}": (
            paged["output_tokens_per_s"] / other["output_tokens_per_s"] if paged and other else None
        )
        for policy, other in best.items()
        if policy != "continuous+paged"
    }


def reserve_vs_paged(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At each load: what continuous+reserve keeps of continuous+paged's figures."""
    by = {(r["load"], r["policy"]): r for r in rows}
    out = []
    for (load, policy), paged in by.items():
        reserve = by.get((load, "continuous+reserve"))
        if policy != "continuous+paged" or reserve is None:
            continue
        out.append(
            {
                "load": load,
                "throughput_ratio": reserve["output_tokens_per_s"] / paged["output_tokens_per_s"],
                "ttft_p50_ratio": _div(reserve["ttft_p50_s"], paged["ttft_p50_s"]),
                "ttft_p99_ratio": _div(reserve["ttft_p99_s"], paged["ttft_p99_s"]),
                "paged_peak_running": paged["peak_running"],
                "reserve_peak_running": reserve["peak_running"],
            }
        )
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _print_sweep(sweep: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="load sweep (simulated)")
    for col in (
        "load",
        "policy",
        "out tok/s",
        "req/s",
        "TTFT p50",
        "TTFT p99",
        "e2e p99",
        "preempt",
        "peak running",
        "KV held",
        "step ms",
        "core µs",
        "real s",
    ):
        t.add_column(col, justify="right")
    for r in sweep["rows"]:
        t.add_row(
            f"×{r['load']:g}",
            r["policy"],
            f"{r['output_tokens_per_s']:.0f}",
            f"{r['requests_per_s']:.2f}",
            f"{r['ttft_p50_s']:.2f}",
            f"{r['ttft_p99_s']:.2f}",
            f"{r['e2e_p99_s']:.1f}",
            str(r["preemptions"]),
            str(r["peak_running"]),
            f"{(r['kv_mean_held_share'] or 0):.0%}",
            f"{r['step_ms']:.1f}",
            f"{r['core_us_per_step']:.0f}",
            f"{r['real_s']:.0f}",
        )
    console = Console(width=190)
    console.print(t)
    for policy, best in sweep["at_slo"].items():
        console.print(
            f"p99 TTFT ≤ {sweep['ttft_slo_s']:g} s: {policy}: "
            + (
                "never met"
                if best is None
                else f"{best['output_tokens_per_s']:.0f} output tokens/s (load ×{best['load']:g})"
            )
        )
    for name, value in sweep["at_slo_ratios"].items():
        if value:
            console.print(f"at p99 TTFT ≤ {sweep['ttft_slo_s']:g} s: {name} = {value:.2f}×")
    for r in sweep["reserve_vs_paged"]:
        console.print(
            f"load ×{r['load']:g}: reserve keeps {r['throughput_ratio']:.0%} of paged's "
            f"throughput; p99 TTFT ×{(r['ttft_p99_ratio'] or 0):.2f}; peak running "
            f"{r['reserve_peak_running']} vs {r['paged_peak_running']}"
        )


# ---- the core of another revision on the same simulations (--baseline-rev) ----------------

BASELINE_SCRIPT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]  # that revision's scheduler_svc, then this tree
from llmserve.bench.run_sim import core_figures, args_from_json
import json
print(json.dumps(core_figures(args_from_json(open(sys.argv[3]).read()))))
"""
CORE_KEYS = ("core_us_per_step", "core_us_median", "core_us_median_full")


def args_to_json(args: argparse.Namespace) -> str:
    """The command's arguments for a child process (JSON, never pickle): paths tagged, the
    subcommand's handler (a function) left out."""
    tagged = {k: _tag(v) for k, v in vars(args).items() if not callable(v)}
    return json.dumps(tagged)


def _tag(v: Any) -> list[Any]:
    if isinstance(v, Path):
        return ["path", str(v)]
    if isinstance(v, Slo):
        return ["slo", [v.ttft_s, v.tpot_s]]
    return ["value", v]


def args_from_json(text: str) -> argparse.Namespace:
    untag = {"path": Path, "slo": lambda v: Slo(*v), "value": lambda v: v}
    tagged = json.loads(text)
    return argparse.Namespace(**{k: untag[kind](v) for k, (kind, v) in tagged.items()})


def core_figures(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each load and policy of `args` simulated again (no report): the core's time per step."""
    cost = CostModel.load(args.cost_model or DEFAULT_COST_MODEL)
    settings = sim_settings(args)
    out = []
    for load in [float(x) for x in args.loads.split(",")]:
        workload = build_workload(args, time_scale=args.time_scale / load)
        for policy in parse_policies(args.policies, args.prefix_caching):
            result = Simulation(settings, policy, cost).run(workload, False)
            counters = result.counters
            row = {k: counters[k] for k in CORE_KEYS}
            out.append({"load": load, "policy": policy.label, **row, "steps": counters["steps"]})
    return out


def baseline_core(args: argparse.Namespace, rev: str) -> list[dict[str, Any]] | None:
    """`core_figures` with the scheduler core of git revision `rev` (None if it cannot run)."""
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            archive = subprocess.run(
                ["git", "-C", str(root), "archive", rev, "scheduler_svc"],
                check=True,
                capture_output=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            # `rev`'s modules first; those it lacks (the step-time model) from this tree's
            here = root / "scheduler_svc"
            with (Path(tmp) / "scheduler_svc" / "__init__.py").open("a") as init:
                init.write(f"\n__path__.append({str(here)!r})\n")
            saved = Path(tmp) / "args.json"
            saved.write_text(args_to_json(args))
            out = subprocess.run(
                [sys.executable, "-c", BASELINE_SCRIPT, tmp, str(root), str(saved)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        except (subprocess.CalledProcessError, OSError) as e:
            print(f"--baseline-rev {rev}: could not run its core ({e})", file=sys.stderr)
            return None
    return json.loads(out.strip().splitlines()[-1])


def print_core_side_by_side(
    rows: list[dict[str, Any]], baseline: list[dict[str, Any]] | None, rev: str
) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"the scheduler core's real µs per step: this tree and {rev}")
    for col in ("load", "policy", "steps", "mean", "median", "median ≥90% running"):
        t.add_column(col, justify="right")
    t.add_column(f"at {rev}: mean / median / ≥90%", justify="right")
    t.add_column("speed-up (median ≥90%)", justify="right")
    theirs = {(b["load"], b["policy"]): b for b in baseline or []}
    for r in rows:
        b = theirs.get((r["load"], r["policy"]))
        ours = [r[k] for k in CORE_KEYS]
        then = [b[k] for k in CORE_KEYS] if b else [None] * 3
        ratio = _div(then[2], ours[2])
        t.add_row(
            f"×{r['load']:g}",
            r["policy"],
            str(r["steps"]),
            *(_us(v) for v in ours),
            " / ".join(_us(v) for v in then),
            f"{ratio:.1f}×" if ratio else "-",
        )
    Console(width=190).print(t)


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def sim_settings(args: argparse.Namespace) -> SimSettings:
    try:
        return _read_settings(args)
    except ValueError as e:
        raise SystemExit(f"llmserve bench sim: {e}") from None


def _read_settings(args: argparse.Namespace) -> SimSettings:
    return SimSettings(
        workers=args.sim_workers,
        kv_capacity=args.kv_capacity,
        block_size=args.block_size,
        token_budget=args.token_budget,
        step_time_budget_ms=args.step_time_budget_ms,
        step_time_window=args.step_time_window,
        max_running=args.max_running,
        max_context=args.max_context,
        speedup=args.speedup,
        step_overhead_s=args.step_overhead,
        worker_speeds=tuple(float(v) for v in args.sim_worker_speeds.split(",") if v),
        speculative=getattr(args, "speculative", "off"),
        speculative_length=getattr(args, "speculative_length", "auto"),
    )
