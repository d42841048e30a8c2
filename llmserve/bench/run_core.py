"""`llmserve bench core`: microseconds per schedule() against running, admitted and waiting."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmserve.bench.core_cost import CoreCost, core_cost, default_grid
from llmserve.bench.report import machine

BASELINE_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from llmserve.bench.core_cost import core_cost
rows = []
for running, waiting, admit in json.loads(sys.argv[2]):
    c = core_cost(running, waiting, admit)
    rows.append([c.schedule_us, c.postprocess_us])
print(json.dumps(rows))
"""


def baseline_costs(rev: str, grid: list[tuple[int, int, int]]) -> list[list[float]]:
    """The grid measured with the core of an earlier revision (a git archive of it, run in a
    subprocess of this Python): [schedule µs, postprocess µs] per row."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "archive", rev, "scheduler_svc", "llmserve/bench/core_cost.py"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        (Path(tmp) / "llmserve" / "__init__.py").touch()
        (Path(tmp) / "llmserve" / "bench" / "__init__.py").touch()
        out = subprocess.run(
            [sys.executable, "-c", BASELINE_SCRIPT, tmp, json.dumps(grid)],
            check=True,
            capture_output=True,
            text=True,
            cwd=tmp,
        ).stdout
    return json.loads(out)


def run_core(args: argparse.Namespace, command: str) -> int:
    """Each row: this core and the baseline's measured back to back, `--rounds` times, the
    fastest of each kept (this machine's speed drifts over minutes; interleaving keeps the
    ratio honest)."""
    grid = default_grid(args.quick)
    rows: list[CoreCost] = []
    base: list[list[float]] | None = [] if args.baseline_rev else None
    for running, waiting, admit in grid:
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(core_cost(running, waiting, admit))
            if base is not None:
                try:
                    theirs.append(baseline_costs(args.baseline_rev, [(running, waiting, admit)])[0])
                except (subprocess.CalledProcessError, OSError) as err:  # e.g. a shallow clone
                    print(f"no baseline: {args.baseline_rev} could not be measured ({err})")
                    base = None
        cost = min(ours, key=lambda c: c.schedule_us + c.postprocess_us)
        rows.append(cost)
        if base is not None:
            base.append(min(theirs, key=sum))
        if not args.no_progress:
            print(
                f"  running {running}, admitted/step {admit}, waiting {waiting}: "
                f"{cost.schedule_us + cost.postprocess_us:.0f} µs"
                + (f" (baseline {sum(base[-1]):.0f} µs)" if base else ""),
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
        "schedule+post µs",
        *([f"at {args.baseline_rev} µs", "speed-up"] if base else []),
    ):
        t.add_column(col, justify="right")
    for i, c in enumerate(rows):
        total = c.schedule_us + c.postprocess_us
        extra = [f"{sum(base[i]):.0f}", f"{sum(base[i]) / total:.1f}x"] if base else []
        t.add_row(
            str(c.running),
            str(c.admitted_per_step),
            f"{c.waiting:,}",
            f"{c.schedule_us:.0f}",
            f"{c.postprocess_us:.0f}",
            f"{c.snapshot_us:.0f}",
            f"{total:.0f}",
            *extra,
        )
    Console(width=120).print(t)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(
        json.dumps(
            {
                "command": command,
                "machine": machine(),
                "rows": [asdict(c) for c in rows],
                "baseline": {"rev": args.baseline_rev, "rows": base} if base else None,
            },
            indent=1,
        )
    )
    print(f"wrote {path}")
    return 0
