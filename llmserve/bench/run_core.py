"""`llmserve bench core`: microseconds per schedule() against running, admitted and waiting."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from llmserve.bench.core_cost import core_cost, default_grid
from llmserve.bench.report import machine


def run_core(args: argparse.Namespace, command: str) -> int:
    rows = []
    for running, waiting, admit in default_grid(args.quick):
        cost = core_cost(running, waiting, admit)
        rows.append(cost)
        if not args.no_progress:
            print(
                f"  running {running}, admitted/step {admit}, waiting {waiting}: "
                f"{cost.schedule_us:.0f} µs",
                flush=True,
            )
    t = Table(title="scheduler core cost per step (one worker; fastest of 30 steps)")
    for col in (
        "running",
        "admitted/step",
        "waiting",
        "schedule() µs",
        "postprocess() µs",
        "snapshot() µs",
    ):
        t.add_column(col, justify="right")
    for c in rows:
        t.add_row(
            str(c.running),
            str(c.admitted_per_step),
            f"{c.waiting:,}",
            f"{c.schedule_us:.0f}",
            f"{c.postprocess_us:.0f}",
            f"{c.snapshot_us:.0f}",
        )
    Console(width=120).print(t)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(
        json.dumps(
            {"command": command, "machine": machine(), "rows": [asdict(c) for c in rows]}, indent=1
        )
    )
    print(f"wrote {path}")
    return 0
