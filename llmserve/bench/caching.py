"""Prefix caching on against off: the runs of one policy side by side, with the ratios."""

from __future__ import annotations

from typing import Any

ON, OFF = " cache on", " cache off"  # the suffixes of Policy.label


def caching_pairs(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each policy run with caching on and off: the figures of both, and how many times
    lower (TTFT, prefill computed) or higher (throughput) they are with caching on."""
    by = {s["label"]: s for s in summaries}
    out = []
    for label, on in by.items():
        if not label.endswith(ON):
            continue
        base = label.removesuffix(ON)
        off = by.get(base + OFF)
        if off is None:
            continue
        row = {"policy": base, "on": figures(on), "off": figures(off)}
        row["ttft_p50_lower"] = _div(row["off"]["ttft_p50_s"], row["on"]["ttft_p50_s"])
        row["ttft_p99_lower"] = _div(row["off"]["ttft_p99_s"], row["on"]["ttft_p99_s"])
        row["later_turns_ttft_p50_lower"] = _div(
            row["off"]["later_ttft_p50_s"], row["on"]["later_ttft_p50_s"]
        )
        row["prefill_computed_lower"] = _div(
            row["off"]["prefill_computed"], row["on"]["prefill_computed"]
        )
        row["throughput_higher"] = _div(
            row["on"]["output_tokens_per_s"], row["off"]["output_tokens_per_s"]
        )
        out.append(row)
    return out


def figures(s: dict[str, Any]) -> dict[str, Any]:
    p = s["prefix"]
    later = s.get("ttft_later_turns_s") or {}
    return {
        "ttft_p50_s": (s["ttft_s"] or {}).get("p50"),
        "ttft_p99_s": (s["ttft_s"] or {}).get("p99"),
        "later_ttft_p50_s": later.get("p50"),
        "prompt_tokens": p["prompt_tokens"],
        "prefill_computed": p["prefill_computed"],
        "computed_share": p["computed_share"],
        "hit_rate": p["hit_rate"],
        "evictions": p["evictions"],
        "preemptions": s["preemptions"],
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
        "ok": f"{s['ok']}/{s['requests']}",
    }


def print_caching(pairs: list[dict[str, Any]], reuse: dict[str, Any] | None = None) -> None:
    """One table per policy; `reuse`: a hash trace's own repeated share, to compare with."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    for row in pairs:
        t = Table(title=f"prefix caching, {row['policy']}: on against off (same arrivals)")
        for col in ("", "caching on", "caching off", "off / on"):
            t.add_column(col, justify="right")
        on, off = row["on"], row["off"]
        t.add_row("requests ok", on["ok"], off["ok"], "")
        t.add_row(
            "TTFT p50", _s(on["ttft_p50_s"]), _s(off["ttft_p50_s"]), _x(row["ttft_p50_lower"])
        )
        t.add_row(
            "TTFT p99", _s(on["ttft_p99_s"]), _s(off["ttft_p99_s"]), _x(row["ttft_p99_lower"])
        )
        if on["later_ttft_p50_s"] is not None:
            t.add_row(
                "TTFT p50, turns 2+",
                _s(on["later_ttft_p50_s"]),
                _s(off["later_ttft_p50_s"]),
                _x(row["later_turns_ttft_p50_lower"]),
            )
        t.add_row(
            "prefill tokens computed",
            _computed(on),
            _computed(off),
            _x(row["prefill_computed_lower"]),
        )
        t.add_row("hit rate", _pct(on["hit_rate"]), _pct(off["hit_rate"]), "")
        t.add_row("evictions", str(on["evictions"] or 0), str(off["evictions"] or 0), "")
        t.add_row("preemptions", str(on["preemptions"]), str(off["preemptions"]), "")
        t.add_row(
            "output tokens/s",
            f"{on['output_tokens_per_s']:.1f}",
            f"{off['output_tokens_per_s']:.1f}",
            _x(_div(off["output_tokens_per_s"], on["output_tokens_per_s"])),
        )
        console.print(t)
        if reuse:
            saved = 1 - (on["prefill_computed"] or 0) / (off["prefill_computed"] or 1)
            console.print(
                f"prefill compute saved {saved:.1%} (computed on / off, recomputation after "
                f"preemption included) against the trace's repeated blocks "
                f"{reuse['repeated_block_share']:.1%} ({reuse['repeated_token_share']:.1%} of "
                "its prompt tokens)"
            )


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}×"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _computed(f: dict[str, Any]) -> str:
    n = f["prefill_computed"]
    return "-" if n is None else f"{n:,} ({f['computed_share']:.0%})"
