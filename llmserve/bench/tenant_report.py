"""A run's figures per tenant and per SLO class: requests, served tokens/s, TTFT, TPOT and
goodput against each request's own class targets; Jain's index over the tenants' weighted
service rates; the service difference between backlogged tenants beside VTC's bound."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from llmcommon.tenancy import Tenancy
from llmserve.bench.fairness import jain, vtc_bound
from llmserve.bench.goodput import tpot_s
from llmserve.bench.records import RequestRecord, RunResult
from llmserve.bench.report import fmt_pct, fmt_time
from llmserve.bench.simulate import SimSettings
from llmserve.bench.stats import percentiles
from llmserve.bench.workload import Workload

NO_CLASS = "(none)"


def meets_class(record: RequestRecord, tenancy: Tenancy) -> bool:
    """Finished within its class's TTFT and TPOT targets (a target of 0 is none; a one-token
    answer has no TPOT to miss)."""
    if not record.ok or record.ttft_s is None:
        return False
    if tenancy.ttft_s and record.ttft_s > tenancy.ttft_s:
        return False
    tpot = tpot_s(record)
    return not tenancy.tpot_s or tpot is None or tpot <= tenancy.tpot_s


def group_figures(records: list[RequestRecord], tenancy: dict[int, Tenancy]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    span = max((r.end_s or 0.0) for r in ok) - min(r.scheduled_s for r in ok) if ok else 0.0
    targeted = [r for r in records if tenancy[r.index].ttft_s or tenancy[r.index].tpot_s]
    met = sum(1 for r in targeted if meets_class(r, tenancy[r.index]))
    late = sum(1 for r in targeted if _late(r, tenancy[r.index]))
    slow = sum(1 for r in targeted if _slow(r, tenancy[r.index]))
    tpots = [t for t in map(tpot_s, ok) if t is not None]
    return {
        "requests": len(records),
        "ok": len(ok),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "served_tokens": prompt + output,
        "span_s": span,
        "served_tokens_per_s": (prompt + output) / span if span else 0.0,
        "output_tokens_per_s": output / span if span else 0.0,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": percentiles(tpots),
        "goodput": None
        if not targeted
        else {
            "met": met,
            "share": met / len(targeted),
            "goodput_rps": met / span if span else 0.0,
            "missed_ttft": late,  # first token after the class's TTFT target (or never)
            "missed_tpot": slow,  # finished, its mean time per output token over the target
        },
    }


def _late(record: RequestRecord, tenancy: Tenancy) -> bool:
    if record.ttft_s is None or not record.ok:
        return True
    return bool(tenancy.ttft_s) and record.ttft_s > tenancy.ttft_s


def _slow(record: RequestRecord, tenancy: Tenancy) -> bool:
    tpot = tpot_s(record) if record.ok else None
    return bool(tenancy.tpot_s) and tpot is not None and tpot > tenancy.tpot_s


def tenant_summary(result: RunResult, workload: Workload, settings: SimSettings) -> dict[str, Any]:
    tenancy = {r.index: r.tenancy or Tenancy() for r in workload.requests}
    by_tenant: dict[str, list[RequestRecord]] = defaultdict(list)
    by_class: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in result.records:
        t = tenancy[record.index]
        by_tenant[t.tenant].append(record)
        by_class[t.slo_class or NO_CLASS].append(record)
    tenants = {name: group_figures(rs, tenancy) for name, rs in by_tenant.items()}
    ledger = result.counters.get("tenants") or {"weighted_service": {}, "pairs": []}
    for name, figures in tenants.items():
        weighted = ledger["weighted_service"].get(name, 0.0)
        figures["weighted_service"] = weighted
        figures["weighted_service_per_s"] = (
            weighted / figures["span_s"] if figures["span_s"] else 0.0
        )
    batch = settings.token_budget * settings.workers
    bound = vtc_bound(
        max((r.prompt_tokens for r in workload.requests), default=0),
        max((r.output_tokens for r in workload.requests), default=0),
        batch,
    )
    return {
        "tenants": tenants,
        "classes": {name: group_figures(rs, tenancy) for name, rs in by_class.items()},
        "jain_index": jain([f["weighted_service_per_s"] for f in tenants.values()]),
        "service_difference": {"pairs": ledger["pairs"], "vtc_bound": bound, "batch_tokens": batch},
    }


def tenant_section(
    results: list[RunResult], workload: Workload, settings: SimSettings
) -> dict[str, Any]:
    """Every run's tenant summary, by label, and each tenant's output tokens/s over its figure
    in the run of the same policy under fcfs (a label `POLICY QUEUE` against `POLICY fcfs`)."""
    summaries = {r.label: tenant_summary(r, workload, settings) for r in results}
    ratios: dict[str, dict[str, float | None]] = {}
    for label, s in summaries.items():
        fcfs = summaries.get(label.rpartition(" ")[0] + " fcfs")
        if fcfs is None:
            continue
        ratios[label] = {
            name: _ratio(f["output_tokens_per_s"], fcfs["tenants"][name]["output_tokens_per_s"])
            for name, f in s["tenants"].items()
        }
    return {"runs": summaries, "output_tokens_per_s_vs_fcfs": ratios}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def print_tenant_section(section: dict[str, Any], prompts: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=190)
    for label, s in section["runs"].items():
        t = Table(title=f"{label}: per tenant and per SLO class (prompts: {prompts})")
        for col in ("", "ok / sent", "served tok/s", "out tok/s", "× fcfs", "TTFT p50/p90/p99",
                    "TPOT p50/p90", "goodput req/s (met)", "missed TTFT / TPOT",
                    "weighted service/s"):  # fmt: skip
            t.add_column(col, justify="right")
        ratios = section["output_tokens_per_s_vs_fcfs"].get(label, {})
        for kind, groups in (("tenant", s["tenants"]), ("class", s["classes"])):
            for name, f in groups.items():
                ratio = ratios.get(name) if kind == "tenant" else None
                t.add_row(
                    f"{kind} {name}",
                    f"{f['ok']} / {f['requests']}",
                    f"{f['served_tokens_per_s']:.0f}",
                    f"{f['output_tokens_per_s']:.0f}",
                    "-" if ratio is None else f"{ratio:.2f}×",
                    fmt_pct(f["ttft_s"]),
                    _two(f["tpot_s"]),
                    _goodput(f["goodput"]),
                    _missed(f["goodput"]),
                    f"{f['weighted_service_per_s']:.0f}" if kind == "tenant" else "-",
                )
        console.print(t)
        jain_index = s["jain_index"]
        console.print("Jain's index over the tenants' weighted service rates: "
                      + ("-" if jain_index is None else f"{jain_index:.3f}"))  # fmt: skip
        gap = s["service_difference"]
        for pair in gap["pairs"]:
            a, b = pair["tenants"]
            ratio = pair["service_ratio"]
            console.print(
                f"{a} vs {b}: max weighted service difference while both backlogged "
                f"{pair['max_difference']:.0f} (VTC bound {gap['vtc_bound']:.0f}, M = "
                f"{gap['batch_tokens']}); {pair['backlogged_steps']} steps in "
                f"{pair['backlogged_stretches']} stretches; service {a}/{b} then "
                + ("-" if ratio is None else f"{ratio:.3f}")
            )


def _two(p: dict[str, float] | None) -> str:
    return "-" if not p else f"{fmt_time(p['p50'])} / {fmt_time(p['p90'])}"


def _missed(g: dict[str, Any] | None) -> str:
    return "-" if g is None else f"{g['missed_ttft']} / {g['missed_tpot']}"


def _goodput(g: dict[str, Any] | None) -> str:
    return "-" if g is None else f"{g['goodput_rps']:.2f} ({g['share']:.0%})"
