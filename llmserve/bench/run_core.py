"""`llmserve bench core`: microseconds per schedule() against running, admitted and waiting."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmserve.bench.core_cost import (
    EVICTS,
    NEVER_EVICTS,
    CoreCost,
    core_cost,
    default_grid,
)
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


PREFIX_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from llmserve.bench.core_cost import prefix_cost
print(json.dumps([prefix_cost(256, c, p).total_us for c, p in json.loads(sys.argv[2])]))
"""
PREFIX_ROWS = [(False, NEVER_EVICTS), (True, NEVER_EVICTS), (True, EVICTS)]


def _tree_of(rev: str, tmp: str) -> None:
    """The scheduler core of `rev` and this tree's core_cost.py (its scenarios), under `tmp`."""
    archive = subprocess.run(
        ["git", "archive", rev, "scheduler_svc", "llmserve/bench/core_cost.py"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    # `rev`'s files first; the rest of llmserve (the runtime its core imports) from this tree
    here = Path(__file__).resolve().parent
    for package, real in (
        (Path(tmp) / "llmserve", here.parent),
        (Path(tmp) / "llmserve" / "bench", here),
    ):
        (package / "__init__.py").write_text(f"__path__.append({str(real)!r})\n")


def _run_script(script: str, root: str, rows: list) -> list:
    """What `script` prints (JSON), run by this Python in `root` with `root` and `rows` as its
    arguments."""
    out = subprocess.run(
        [sys.executable, "-c", script, root, json.dumps(rows)],
        check=True,
        capture_output=True,
        text=True,
        cwd=root,
    ).stdout
    return json.loads(out)


def prefix_baseline(rev: str) -> list[float] | None:
    """PREFIX_ROWS' µs per step with the core of `rev` (None if it cannot run them)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            _tree_of(rev, tmp)
            here = Path(__file__).with_name("core_cost.py")
            (Path(tmp) / "llmserve" / "bench" / "core_cost.py").write_text(here.read_text())
            return _run_script(PREFIX_SCRIPT, tmp, PREFIX_ROWS)
        except (subprocess.CalledProcessError, OSError):
            return None


def prefix_here() -> list[float]:
    """PREFIX_ROWS' µs per step with this tree's core, in a fresh process as the baselines are
    (in this one, what earlier rows left in the heap would weigh on its collector)."""
    return _run_script(PREFIX_SCRIPT, str(Path(__file__).resolve().parents[2]), PREFIX_ROWS)


def run_prefix(revs: list[str], rounds: int) -> dict:
    """Per-step core time at 256 running with long prompts: caching off, on with a pool that
    never evicts, on with one that evicts; medians per step, the median of `rounds` runs, this
    core and each of `revs`' measured in turn (the same load on all, so the ratios hold on a
    shared host)."""
    ours: list[list[float]] = []
    theirs: dict[str, list[list[float]]] = {rev: [] for rev in revs}
    for _ in range(rounds):
        ours.append(prefix_here())
        for rev in revs:
            base = prefix_baseline(rev)
            if base is not None:
                theirs[rev].append(base)
    measured = [rev for rev in revs if theirs[rev]]
    t = Table(title="core µs per step, 256 running, 15,360-token prompts (medians)")
    for col in ("prefix caching", "pool", "µs per step"):
        t.add_column(col, justify="right")
    for rev in measured:
        t.add_column(f"at {rev}", justify="right")
        t.add_column("speed-up", justify="right")
    rows = []
    for i, (caching, positions) in enumerate(PREFIX_ROWS):
        now = statistics.median(r[i] for r in ours)
        then = {rev: statistics.median(r[i] for r in theirs[rev]) for rev in measured}
        pool = "never evicts" if positions == NEVER_EVICTS else f"{positions:,} positions"
        extra = [x for rev in measured for x in (f"{then[rev]:.0f}", f"{then[rev] / now:.1f}x")]
        t.add_row("on" if caching else "off", pool, f"{now:.0f}", *extra)
        rows.append({"caching": caching, "positions": positions, "us": now, "baseline_us": then})
    Console(width=140).print(t)
    return {"revs": measured, "rounds": rounds, "rows": rows}


def baseline_costs(rev: str, grid: list[tuple[int, int, int]]) -> list[list[float]]:
    """The grid measured with the core of an earlier revision (a git archive of it, run in a
    subprocess of this Python): [schedule µs, postprocess µs] per row."""
    with tempfile.TemporaryDirectory() as tmp:
        _tree_of(rev, tmp)
        return _run_script(BASELINE_SCRIPT, tmp, grid)


def run_core(args: argparse.Namespace, command: str) -> int:
    """Each row: this core and the baseline's measured back to back, `--rounds` times, the
    fastest of each kept (this machine's speed drifts over minutes; interleaving keeps the
    ratio honest)."""
    grid = [] if getattr(args, "prefix_only", False) else default_grid(args.quick)
    tenants, policy = getattr(args, "tenants", 0), getattr(args, "queue_policy", "")
    rows: list[CoreCost] = []
    base: list[list[float]] | None = [] if args.baseline_rev else None
    for running, waiting, admit in grid:
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(core_cost(running, waiting, admit, tenants=tenants, policy=policy))
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
    among = f"; {tenants} tenants" if tenants else ""
    ordered = f", queue policy {policy}" if policy else ""
    t = Table(
        title=f"scheduler core cost per step (one worker; fastest of 30 steps{among}{ordered})"
    )
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
    if rows:
        Console(width=120).print(t)
    revs = [r for r in (getattr(args, "prefix_revs", "") or args.baseline_rev).split(",") if r]
    prefix = run_prefix(revs, args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(
        json.dumps(
            {
                "command": command,
                "machine": machine(),
                "rows": [asdict(c) for c in rows],
                "baseline": {"rev": args.baseline_rev, "rows": base} if base else None,
                "prefix": prefix,
            },
            indent=1,
        )
    )
    print(f"wrote {path}")
    return 0
