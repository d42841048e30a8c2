"""The GPU check's report: one JSON of every figure and a short markdown that docs/gpu.md can take
as it is. Every section is there, with its figures or with `skipped: why` / `failed: why`; none
is left out and none is made up. Standard library only."""

from __future__ import annotations

import json
from pathlib import Path

SECTIONS = ("logits", "kernels", "forward_timings", "kv_sizing", "served")


def section(status: str, reason: str = "", results: list | None = None) -> dict:
    """status: ok, failed or skipped; reason: why it failed or was skipped."""
    out: dict = {"status": status, "results": results or []}
    if reason:
        out["reason"] = reason
    return out


def write(report: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    data, text = out / "gpu-check.json", out / "gpu-check.md"
    data.write_text(json.dumps(report, indent=1) + "\n")
    text.write_text(markdown(report))
    return data, text


def markdown(report: dict) -> str:
    env = report.get("environment", {})
    lines = [
        f"### GPU check: {env.get('device_name', '?')} ({env.get('device', '?')})",
        "",
        f"`{report.get('command', '')}` — {report.get('total_s', 0):.0f} s, "
        f"{'passed' if report.get('passed') else 'FAILED'}; python {env.get('python')}, torch "
        f"{env.get('torch')} (CUDA {env.get('cuda')}), triton {env.get('triton')}, transformers "
        f"{env.get('transformers')}, grpcio {env.get('grpcio')}, protobuf {env.get('protobuf')}. "
        "Random weights at the real shapes (nothing downloaded).",
    ]
    sections = report.get("sections", {})
    for name in SECTIONS:
        part = sections.get(name) or section("skipped", "not reached (the run ended first)")
        lines += ["", f"**{name.replace('_', ' ')}**: {part['status']}"]
        if part.get("reason"):
            lines[-1] += f": {part['reason']}"
        if part.get("results"):
            lines += RENDER[name](part["results"])
    return "\n".join(lines) + "\n"


def _logits(results: list) -> list[str]:
    head = (
        "shape | dtype | max abs diff vs transformers | ours / theirs vs fp32 | greedy agreement "
        "| graphs vs eager | ok"
    )
    rows = [_logit_row(r["shape"], dtype, r[dtype]) for r in results for dtype in ("fp32", "bf16")]
    return _table(head, "llrrrrl", rows)


def _logit_row(shape: str, dtype: str, d: dict) -> str:
    return (
        f"| {shape} | {dtype} | {d['max_abs_diff_vs_transformers']:.2e} | "
        f"{d['ours_max_abs_diff_vs_fp32_reference']:.2e} / "
        f"{d['theirs_max_abs_diff_vs_fp32_reference']:.2e} | "
        f"{100 * d['greedy_agreement']:.0f}% | {graphs_vs_eager(d)} | "
        f"{'ok' if d['ok'] else 'FAILED'} |"
    )


def graphs_vs_eager(d: dict) -> str:
    """Our CUDA-graph path's max abs diff from our eager path, and its greedy agreement."""
    if "graphs_max_abs_diff_vs_eager" not in d:
        return "—"
    diff, same = d["graphs_max_abs_diff_vs_eager"], d["graphs_greedy_agreement_vs_eager"]
    return f"{diff:.2e}, {100 * same:.0f}%"


def _kernels(results: list) -> list[str]:
    return [f"- {'native' if r['native'] else 'interpreter'} ({r['selection']}): {r['summary']}"
            for r in results]  # fmt: skip


def _timings(results: list) -> list[str]:
    head = (
        "shape | case | ours, graphs on (ms) | ours, graphs off (ms) | transformers sdpa (ms) | "
        "speed-up (verify: its cost)"
    )
    rows = [_timing_row(r["shape"], case, t) for r in results for case, t in r["ms"].items()]
    graphs = results[0]["cuda_graphs"]
    note = f"bf16, {results[0]['context']} cached positions per decode row; CUDA graphs {graphs}"
    return _table(head, "llrrrr", rows) + ["", note]


def _timing_row(shape: str, case: str, t: dict) -> str:
    """A verify row has no transformers figure: its last column is its cost in decode steps."""
    on, theirs = t.get("ours_graphs_on"), t.get("transformers_sdpa")
    if theirs is None:
        cost = t.get("times_a_decode")
        last = "—" if cost is None else f"{cost:.2f} decode steps"
    else:
        last = f"{t['speedup_vs_transformers']:.2f}x"
    return (
        f"| {shape} | {case} | {'—' if on is None else f'{on:.2f}'} | "
        f"{t['ours_graphs_off']:.2f} | {'—' if theirs is None else f'{theirs:.2f}'} | {last} |"
    )


def _kv(results: list) -> list[str]:
    head = "shape | positions | pool GiB | bytes / position | in use before GiB"
    rows = [
        f"| {r['shape']} | {r['positions']:,} | {r['pool_gib']:.2f} | "
        f"{r['bytes_per_position']:,} | {r['used_before_gib']:.2f} |"
        for r in results
    ]
    return _table(head, "lrrrr", rows)


def _served(results: list) -> list[str]:
    head = (
        "shape | concurrent | output tok/s | tokens / step | worker busy | forward ms / step | "
        "outside forward ms / step"
    )
    rows = [
        _served_row(r["shape"], level, c) for r in results for level, c in r["concurrency"].items()
    ]
    r = results[0]
    note = (
        f"{r['dtype']}, {r['max_tokens']} tokens per request, {r['window_s']:g} s windows, "
        f"KV {r['kv_capacity']}"
    )
    return _table(head, "lrrrrrr", rows) + ["", note]


def _served_row(shape: str, level: str, c: dict) -> str:
    return (
        f"| {shape} | {level} | {c['output_tok_s']:,.0f} | {c.get('tokens_per_step', '—')} | "
        f"{100 * c['worker_busy']:.1f}% | "
        f"{c['step_ms']:.2f} | {c['outside_forward_ms_per_step']:.2f} |"
    )


def _table(head: str, align: str, rows: list[str]) -> list[str]:
    """A markdown table after a blank line: `head` "a | b", `align` an l or r per column."""
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return ["", f"| {head} |", rule, *rows]


RENDER = {
    "logits": _logits,
    "kernels": _kernels,
    "forward_timings": _timings,
    "kv_sizing": _kv,
    "served": _served,
}
