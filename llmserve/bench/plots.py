"""PNG plots of a report (matplotlib, Agg backend): throughput, latency, KV over time, stalls."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from llmserve.bench.records import RunResult, StatusSample  # noqa: E402

Draw = Callable[[Any, list[float], list[StatusSample]], None]  # (axes, seconds, samples)

LATENCIES = [
    ("ttft_s", "time to first token"),
    ("itl_s", "inter-token"),
    ("e2e_s", "end-to-end"),
    ("queue_s", "queue time"),
]


def write_plots(
    out_dir: Path,
    name: str,
    summaries: list[dict[str, Any]],
    results: list[RunResult],
    subtitle: str = "",
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        _save(throughput(summaries, subtitle), out_dir / f"{name}-throughput.png"),
        _save(latency(summaries, subtitle), out_dir / f"{name}-latency.png"),
        _save(stalls(summaries, subtitle), out_dir / f"{name}-stalls.png"),
    ]
    timed = [r for r in results if r.samples]
    if timed:
        paths.append(_save(kv_over_time(timed, subtitle), out_dir / f"{name}-kv.png"))
        paths.append(_save(queue_over_time(timed, subtitle), out_dir / f"{name}-queue.png"))
    return paths


def throughput(summaries: list[dict[str, Any]], subtitle: str):
    labels = [s["label"] for s in summaries]
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(labels)), 4))
    toks = [s["throughput"]["output_tokens_per_s"] for s in summaries]
    reqs = [s["throughput"]["requests_per_s"] for s in summaries]
    for ax, values, unit in ((a, toks, "output tokens/s"), (b, reqs, "requests/s")):
        bars = ax.bar(range(len(labels)), values, color="tab:blue")
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(unit)
    fig.suptitle(f"Throughput\n{subtitle}", fontsize=9)
    return fig


def latency(summaries: list[dict[str, Any]], subtitle: str):
    labels = [s["label"] for s in summaries]
    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(max(12, 3 * len(labels) + 4), 4))
    width = 0.8 / 3
    for ax, (key, title) in zip(axes, LATENCIES, strict=True):
        for j, q in enumerate(("p50", "p90", "p99")):
            values = [(s[key] or {}).get(q, 0.0) for s in summaries]
            ax.bar([i + (j - 1) * width for i in range(len(labels))], values, width, label=q)
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("seconds")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Latency percentiles\n{subtitle}", fontsize=9)
    return fig


def stalls(summaries: list[dict[str, Any]], subtitle: str):
    reasons = sorted({r for s in summaries for r in s["stalls"]})
    labels = [s["label"] for s in summaries]
    fig, ax = plt.subplots(figsize=(max(7, 2 * len(labels)), 4))
    width = 0.8 / max(1, len(reasons))
    for j, reason in enumerate(reasons):
        values = [s["stalls"].get(reason, 0) for s in summaries]
        ax.bar(
            [i + (j - (len(reasons) - 1) / 2) * width for i in range(len(labels))],
            values,
            width,
            label=reason,
        )
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("steps whose admission stopped")
    if reasons:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no admission stalls", ha="center", transform=ax.transAxes)
    fig.suptitle(f"Admission stalls by reason (scheduler Status)\n{subtitle}", fontsize=9)
    return fig


def kv_over_time(results: list[RunResult], subtitle: str):
    def draw(ax, t: list[float], samples: list[StatusSample]) -> None:
        written = [s.kv_written for s in samples]
        held = [s.kv_held for s in samples]
        ax.fill_between(t, 0, written, color="tab:blue", alpha=0.6, label="written")
        ax.fill_between(
            t, written, held, color="tab:orange", alpha=0.5, hatch="//", label="reserved, unwritten"
        )
        ax.plot(t, [s.kv_capacity for s in samples], "k--", lw=1, label="capacity")

    title = f"KV written / reserved / capacity over time\n{subtitle}"
    return _over_time(results, draw, 2.6, "KV positions", title)


def queue_over_time(results: list[RunResult], subtitle: str):
    def draw(ax, t: list[float], samples: list[StatusSample]) -> None:
        ax.plot(t, [s.running for s in samples], label="running")
        ax.plot(t, [s.waiting for s in samples], label="waiting")

    title = f"Running and waiting requests over time\n{subtitle}"
    return _over_time(results, draw, 2.2, "requests", title)


def _over_time(results: list[RunResult], draw: Draw, height: float, ylabel: str, title: str):
    """One row per run, its Status samples drawn by `draw(ax, t, samples)` against seconds."""
    fig, axes = plt.subplots(len(results), 1, figsize=(10, height * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        draw(ax, [s.t for s in r.samples], r.samples)
        ax.set_ylabel(ylabel)
        ax.set_title(r.label, fontsize=9)
    axes[0, 0].legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> Path:
    if not fig.get_layout_engine():
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
