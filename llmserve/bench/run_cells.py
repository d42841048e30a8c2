"""`llmserve bench sim --cells N --router POLICY[,POLICY...]`: the workload through N cells
(each a simulated scheduler with --sim-workers workers) behind the gateway's router; `single`
among the policies is one scheduler over all N x --sim-workers workers (the same total KV).

Per load and policy: the prefix-cache hit rate (prompt tokens the cells' caches served), the
cells' load imbalance (the busiest cell's busy time over the mean), goodput (requests meeting
--slo per second), TTFT, and how often each reason routed."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from typing import Any

from gateway.routing import RoutePolicy, RouterSettings
from gateway.routing.settings import parse_policy
from llmserve.bench.cells_sim import CellsSimulation
from llmserve.bench.cost_model import DEFAULT_COST_MODEL, CostModel
from llmserve.bench.goodput import Slo
from llmserve.bench.policy import parse_policies
from llmserve.bench.stats import summarize
from llmserve.bench.workload_args import build_workload

SINGLE = "single"  # one scheduler over every cell's workers
DEFAULT_SLO = Slo(ttft_s=2.0, tpot_s=0.1)


def router_settings(args: argparse.Namespace, policy: str) -> RouterSettings:
    """The router's settings from the flags (their defaults are RouterSettings')."""
    given = {
        name: getattr(args, f"router_{name}")
        for name in RouterSettings.__dataclass_fields__
        if getattr(args, f"router_{name}", None) is not None
    }
    return RouterSettings(**given, policy=parse_policy(policy))


def simulate_cells(
    args: argparse.Namespace, cost: CostModel, load: float, router: str, settings
) -> dict[str, Any]:
    """One load and one router's run: its figures, as a flat row."""
    workload = build_workload(args, time_scale=args.time_scale / load)
    policy = parse_policies(args.policies.split(",")[0], args.prefix_caching)[0]
    if router == SINGLE:
        whole = replace(settings, workers=settings.workers * args.cells, worker_speeds=())
        sim = CellsSimulation(whole, policy, cost, 1, RouterSettings(RoutePolicy.LEAST_LOADED))
    else:
        sim = CellsSimulation(settings, policy, cost, args.cells, router_settings(args, router))
    result = sim.run(workload)
    slo = args.slo or DEFAULT_SLO
    s = summarize(result, slo)
    c = result.counters
    return {
        "load": load,
        "router": router,
        "cells": c["cells"],
        "requests": s["requests"],
        "ok": s["ok"],
        "hit_rate": c["hit_rate"],
        "imbalance": c["imbalance"],
        "goodput_rps": s.get("goodput_rps"),
        "slo": slo.label,
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "reasons": c["reasons"],
        "cell_busy_s": c["cell_busy_s"],
        "preemptions": c["preemptions"],
        "virtual_s": c["virtual_s"],
        "real_s": c["real_s"],
        "workload": workload.describe(),
    }


def run_cells(args: argparse.Namespace, command: str, settings) -> int:
    cost = CostModel.load(args.cost_model or DEFAULT_COST_MODEL)
    routers = [r.strip() for r in args.router.split(",") if r.strip()]
    for r in routers:
        if r != SINGLE:
            parse_policy(r)  # a typo fails before any run
    rows = []
    for load in [float(x) for x in args.loads.split(",")]:
        for router in routers:
            row = simulate_cells(args, cost, load, router, settings)
            rows.append(row)
            print(_line(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}-cells.json"
    doc = {"command": command, "simulated_cell": asdict(settings), "rows": rows}
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return 0


def _line(r: dict[str, Any]) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in r["reasons"].items() if v)
    return (
        f"load ×{r['load']:g} {r['router']:>12} ({r['cells']} cells): hit rate "
        f"{r['hit_rate']:.1%}, imbalance {r['imbalance']:.3f}, goodput {r['goodput_rps']:.3f} "
        f"req/s, TTFT p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s, "
        f"{r['ok']}/{r['requests']} ok; routes: {reasons}"
    )
