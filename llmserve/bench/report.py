"""The report of one `llmserve bench` invocation: a terminal table, a JSON file, request CSVs."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from llmserve.bench.goodput import Slo
from llmserve.bench.records import RunResult
from llmserve.bench.stats import summarize

MAX_TIMELINE = 2000  # Status samples kept per run in the JSON


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    try:
        info["load_average_1m"] = os.getloadavg()[0]  # others' work makes figures noisy
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


@dataclass
class Report:
    title: str
    workload: dict[str, Any]
    command: str = ""
    results: list[RunResult] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # ratios, sweeps, notes
    started: float = field(default_factory=time.time)
    machine_start: dict[str, Any] = field(default_factory=machine)
    slo: Slo | None = None  # given: every run's goodput against it

    def add(self, result: RunResult) -> dict[str, Any]:
        self.results.append(result)
        return summarize(result, self.slo)

    def summaries(self) -> list[dict[str, Any]]:
        return [summarize(r, self.slo) for r in self.results]

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)),
            "command": self.command,
            "machine": self.machine_start
            | {"load_average_1m_end": machine().get("load_average_1m")},
            "workload": self.workload,
            "runs": self.summaries(),
            "timelines": {r.label: _timeline(r) for r in self.results if r.samples},
            **self.extra,
        }

    def write(self, out_dir: Path, name: str) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{name}.json"
        text = json.dumps(_finite(self.to_json()), indent=1, default=str, allow_nan=False)
        path.write_text(text)
        written = [path]
        for r in self.results:
            if r.records:
                written.append(write_requests(r, out_dir / f"{name}-{_slug(r.label)}-requests.csv"))
        return written


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinite float as None (unknown): the JSON stays strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_requests(result: RunResult, path: Path) -> Path:
    rows = [r.row() for r in result.records]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _timeline(result: RunResult) -> list[dict[str, Any]]:
    samples = result.samples
    step = max(1, len(samples) // MAX_TIMELINE)
    return [asdict(s) for s in samples[::step]]


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in label)


# ---------------------------------------------------------------------------- terminal table


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def fmt_pct(p: dict[str, float] | None) -> str:
    if not p:
        return "-"
    return " / ".join(fmt_time(p[k]) for k in ("p50", "p90", "p99"))


def fmt_pct_n(p: dict[str, float] | None) -> str:
    """p50 / p90 / p99 with the sample count they come from."""
    return fmt_pct(p) + (f" (n={p['n']})" if p and "n" in p else "")


CAPTION = (
    "Rates are over the run's span (first scheduled arrival to the last end, failed requests "
    "included). Percentiles are over ok requests only; n = samples (inter-token: token gaps). "
    "KV and running rows are from Status samples, not every step."
)


LENGTHS = {True: "", False: " (LENGTH MISMATCH)", None: " (lengths unverified)"}


def table(title: str, summaries: list[dict[str, Any]], reference: str | None = None) -> Table:
    """Runs side by side; ratios against `reference` (a label) where given."""
    t = Table(title=title, show_lines=False, caption=CAPTION, caption_justify="left")
    t.add_column("metric", style="bold")
    for s in summaries:
        t.add_column(s["label"], justify="right")
    ref = next((s for s in summaries if s["label"] == reference), None)

    def row(name: str, fn) -> None:
        t.add_row(name, *[fn(s) for s in summaries])

    row(
        "requests ok / sent",
        lambda s: f"{s['ok']} / {s['requests']}" + LENGTHS[s["exact_lengths"]],
    )
    if any(s.get("tokens_basis") not in (None, "", "token ids") for s in summaries):
        row("tokens counted from", lambda s: s.get("tokens_basis") or "-")
    if any(s.get("errors_by_reason") for s in summaries):
        row("failed, by reason", lambda s: _reasons(s.get("errors_by_reason")))
    row("run span", lambda s: fmt_time(s["duration_s"]))
    row("requests/s", lambda s: f"{s['throughput']['requests_per_s']:.2f}")
    row("output tokens/s", lambda s: f"{s['throughput']['output_tokens_per_s']:.0f}")
    if ref:
        base = ref["throughput"]["output_tokens_per_s"]
        row(
            f"× {reference}",
            lambda s: f"{s['throughput']['output_tokens_per_s'] / base:.2f}×" if base else "-",
        )
    slo = next((s["goodput"] for s in summaries if "goodput" in s), None)
    if slo:
        row(
            f"goodput req/s ({Slo(slo['ttft_s'], slo['tpot_s']).label})",
            lambda s: _goodput(s.get("goodput")),
        )
    row("TTFT p50/p90/p99 (ok)", lambda s: fmt_pct_n(s["ttft_s"]))
    if any("ttft_later_turns_s" in s for s in summaries):
        row("TTFT turn 1 p50/p90/p99 (ok)", lambda s: fmt_pct_n(s.get("ttft_first_turn_s")))
        row("TTFT turns 2+ p50/p90/p99 (ok)", lambda s: fmt_pct_n(s.get("ttft_later_turns_s")))
    row("prefill tokens computed", lambda s: _computed(s["prefix"]))
    row("prefix hit rate", lambda s: _hit_rate(s["prefix"]))
    row("inter-token p50/p90/p99 (ok)", lambda s: fmt_pct_n(s["itl_s"]))
    row("end-to-end p50/p90/p99 (ok)", lambda s: fmt_pct_n(s["e2e_s"]))
    row("queue p50/p90/p99 (ok)", lambda s: fmt_pct_n(s["queue_s"]))
    row(
        "preemptions",
        lambda s: (
            "-"
            if s["kind"] == "transformers" or s["preemptions"] is None
            else str(s["preemptions"])
        ),
    )
    row(
        "stalls (steps)",
        lambda s: ", ".join(f"{k} {v}" for k, v in sorted(s["stalls"].items())) or "-",
    )
    row("Status samples", lambda s: _sampled(s["kv"]))
    row(
        "KV peak written/held/cap (sampled)",
        lambda s: (
            "-"
            if not s["kv"]
            else f"{s['kv']['peak_written']} / {s['kv']['peak_held']:.0f} / {s['kv']['capacity']}"
        ),
    )
    row(
        "KV mean written/held (sampled)",
        lambda s: (
            "-"
            if not s["kv"]
            else f"{s['kv']['mean_written_share']:.0%} / {s['kv']['mean_held_share']:.0%}"
        ),
    )
    row("peak running (sampled)", lambda s: "-" if not s["kv"] else str(s["kv"]["peak_running"]))
    row(
        "gRPC+sched overhead",
        lambda s: (
            "-"
            if not s["overhead"]
            else f"{s['overhead']['overhead_share']:.1%} (core {s['overhead']['core_share']:.1%})"
        ),
    )
    return t


def _reasons(reasons: dict[str, int] | None) -> str:
    return ", ".join(f"{k} {n}" for k, n in reasons.items()) if reasons else "-"


def _sampled(kv: dict[str, Any] | None) -> str:
    if not kv:
        return "-"
    period = kv.get("sample_period_s")
    return f"{kv['samples']}" + (f", every {period:g} s" if period else "")


def _goodput(g: dict[str, Any] | None) -> str:
    return "-" if g is None else f"{g['goodput_rps']:.2f} ({g['share']:.0%})"


def _computed(p: dict[str, Any]) -> str:
    if p["prefill_computed"] is None:
        return "-"
    return f"{p['prefill_computed']:,} of {p['prompt_tokens']:,}"


def _hit_rate(p: dict[str, Any]) -> str:
    rate = p["hit_rate"]
    return "-" if rate is None else f"{rate:.1%} ({p['evictions'] or 0} evictions)"


def print_table(
    title: str,
    summaries: list[dict[str, Any]],
    reference: str | None = None,
    notes: list[str] | None = None,
) -> None:
    console = Console(width=max(120, Console().width))
    console.print(table(title, summaries, reference))
    for note in notes or []:
        console.print(note)
