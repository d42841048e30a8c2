"""`llmserve bench overhead`: run the grid, print the table, write the JSON and Markdown."""

from __future__ import annotations

import argparse
import json

from llmserve.bench.overhead import grid, median_row, rows_json, run_config, table
from llmserve.bench.report import machine


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run_overhead(args: argparse.Namespace, command: str) -> int:
    configs = grid(_floats(args.step_ms), _ints(args.running), _ints(args.workers))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in configs:
        runs = [
            run_config(config, args.out, args.window, args.max_tokens, args.stream_interval_ms)
            for _ in range(args.repeats)
        ]
        row = median_row(runs)
        rows.append(row)
        if not args.no_progress:
            print(
                f"  {config.step_ms:g} ms, {config.running} running, {config.workers} worker(s), "
                f"overlap {'on' if config.overlap else 'off'}: busy {100 * row.busy:.1f}%, "
                f"{row.outside_ms:.2f} ms outside forward / step, {row.bytes_per_step:.0f} B/step, "
                f"{row.tokens_per_s:,.0f} tok/s",
                flush=True,
            )
    text = table(rows)
    print(text)
    (args.out / f"{args.name}.md").write_text(f"`{command}`\n\n{text}\n")
    path = args.out / f"{args.name}.json"
    report = {"command": command, "machine": machine(), "rows": rows_json(rows)}
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0
