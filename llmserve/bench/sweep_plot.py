"""The load sweep in one figure: throughput and p99 TTFT against load, one line per policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def write_sweep_plot(rows: list[dict[str, Any]], path: Path, slo: float) -> Path:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["load"])
        loads = [r["load"] for r in mine]
        a.plot(loads, [r["output_tokens_per_s"] for r in mine], "o-", label=policy)
        b.plot(loads, [r["ttft_p99_s"] for r in mine], "o-", label=policy)
    a.set_xlabel("load (× the trace's arrival rate)")
    a.set_ylabel("output tokens/s")
    a.set_title("throughput")
    b.set_xlabel("load (× the trace's arrival rate)")
    b.set_ylabel("seconds")
    b.set_yscale("log")
    b.axhline(slo, color="k", ls="--", lw=1, label=f"target {slo:g} s")
    b.set_title("p99 time to first token")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.suptitle("Simulated cluster, Azure conv trace (virtual time)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
