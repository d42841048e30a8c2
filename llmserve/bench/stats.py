"""From records to figures: throughput, latency percentiles, KV use, stalls and overhead."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from llmserve.bench.goodput import Slo, goodput
from llmserve.bench.records import RequestRecord, RunResult

QUANTILES = {"p50": 50, "p90": 90, "p99": 99}
DURATION_BASIS = (
    "from the first request's scheduled arrival to the last end of any request, ok or failed "
    "(the denominator of every rate)"
)
PERCENTILES_OVER = "ok requests only; n = the samples (requests, or token gaps for inter-token)"


def percentiles(values: list[float] | np.ndarray) -> dict[str, float] | None:
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return None
    out = {k: float(np.percentile(arr, q)) for k, q in QUANTILES.items()}
    return out | {"mean": float(arr.mean()), "max": float(arr.max()), "n": int(arr.size)}


def summarize(result: RunResult, slo: Slo | None = None) -> dict[str, Any]:
    """`slo`: also the goodput (`goodput_rps`: requests meeting it per second of the run).
    Rates are over the run's span (`run_span`: failed requests' time counts); latency
    percentiles over the ok requests."""
    records = result.records
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    duration = run_span(records) or result.wall_s
    errors = [r.error for r in records if r.error]
    peer = result.config.get("backend") == "openai"  # no server counters: unknown, not 0
    summary: dict[str, Any] = {
        "label": result.label,
        "kind": result.kind,
        "requests": len(records),
        "ok": len(ok),
        "errors": len(errors),
        "errors_by_reason": error_reasons(errors),
        "error_examples": sorted(set(errors))[:3],
        "exact_lengths": exact_lengths(ok),
        "tokens_basis": tokens_basis(ok),
        "usage_notes": sorted({r.usage_note for r in ok if r.usage_note})[:3],
        "duration_s": duration,
        "duration_basis": DURATION_BASIS,
        "wall_s": result.wall_s,
        "percentiles_over": PERCENTILES_OVER,
        "throughput": {
            "requests_per_s": len(ok) / duration if duration else 0.0,
            "output_tokens_per_s": out_tokens / duration if duration else 0.0,
            "total_tokens_per_s": (in_tokens + out_tokens) / duration if duration else 0.0,
        },
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles(_gaps(ok)),
        "tpot_s": percentiles([float(np.mean(r.token_gaps)) for r in ok if r.token_gaps]),
        "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "queue_s": percentiles([r.queue_time_s for r in ok if r.queue_time_s is not None]),
        "preemptions": None if peer else sum(r.preemptions for r in ok),
        "stalls": dict(result.counters.get("stalls", {})),
        "kv": kv_summary(result),
        "overhead": overhead(result.counters),
        "prefix": prefix_summary(result.counters, in_tokens, known=not peer),
        "config": result.config,
    }
    if slo is not None:
        summary["goodput"] = met = goodput(records, slo, duration)
        summary["goodput_rps"] = met["goodput_rps"]
    if any(r.turn >= 0 for r in records):
        timed = [r for r in ok if r.ttft_s is not None]
        summary["ttft_first_turn_s"] = percentiles([r.ttft_s for r in timed if r.turn == 0])
        summary["ttft_later_turns_s"] = percentiles([r.ttft_s for r in timed if r.turn > 0])
    return summary


def prefix_summary(
    counters: dict[str, Any], client_prompt_tokens: int, known: bool = True
) -> dict[str, Any]:
    """Prompt tokens, those served from the prefix cache, and those computed. The scheduler's
    counters when it reports them; the simulation counts the chunks its workers ran (which
    includes recomputation after preemption); else the clients' prompt tokens, all computed
    (a server without a prefix cache), or unknown (None) where not `known` (another server)."""
    prompt = counters.get("prompt_tokens", client_prompt_tokens)
    prompt = counters.get("cache_prompt_tokens", prompt)
    hit = counters.get("cache_hit_tokens")
    computed = counters.get("prefill_computed", None if hit is None else prompt - hit)
    if hit is None and computed is None and known:
        computed = prompt
    return {
        "prompt_tokens": prompt,
        "hit_tokens": hit,
        "hit_rate": hit / prompt if hit is not None and prompt else None,
        "prefill_computed": computed,
        "computed_share": computed / prompt if computed is not None and prompt else None,
        "evictions": counters.get("cache_evictions"),
        "source": "scheduler" if hit is not None else "clients",
    }


def exact_lengths(ok: list[RequestRecord]) -> bool | None:
    """Every ok request's output of its workload's length: True, False, or None (unknown:
    some counts are chunks of an OpenAI-compatible server, which may carry several tokens)."""
    if any(r.completion_tokens != r.expected_tokens for r in ok):
        return False
    return None if any(r.tokens_basis == "chunks" for r in ok) else True


def tokens_basis(ok: list[RequestRecord]) -> str:
    """Where the ok requests' token counts came from: `token ids`, `usage`, `chunks` (see
    RequestRecord.tokens_basis), or `mixed` with the count of each."""
    bases = Counter(r.tokens_basis for r in ok)
    if len(bases) <= 1:
        return next(iter(bases), "")
    return "mixed (" + ", ".join(f"{k} {n}" for k, n in sorted(bases.items())) + ")"


def kv_summary(result: RunResult) -> dict[str, Any] | None:
    samples = [s for s in result.samples if s.kv_capacity]
    if not samples:
        return None
    capacity = max(s.kv_capacity for s in samples)
    busy = [s for s in samples if s.running or s.waiting] or samples
    return {
        "capacity": capacity,
        "peak_written": max(s.kv_written for s in samples),
        "peak_held": max(s.kv_held for s in samples),
        "mean_written_share": float(np.mean([s.kv_written / capacity for s in busy])),
        "mean_held_share": float(np.mean([s.kv_held / capacity for s in busy])),
        "peak_running": max(s.running for s in samples),
        "peak_waiting": max(s.waiting for s in samples),
        "samples": len(samples),
        "sample_period_s": result.sample_period_s,
        "sampled": "peaks and means over these Status samples, not over every step",
    }


def overhead(counters: dict[str, Any]) -> dict[str, float] | None:
    """Shares of the step loop's wall time: forward passes, the core, and the rest (gRPC,
    protobuf, event dispatch). From the scheduler's Status counters over the run."""
    step = counters.get("step_seconds", 0.0)
    if not step:
        return None
    forward, core = counters["forward_seconds"], counters["core_seconds"]
    steps = counters["executed_steps"]
    return {
        "executed_steps": steps,
        "step_ms": 1000 * step / steps,
        "forward_ms": 1000 * forward / steps,
        "core_ms": 1000 * core / steps,
        "overhead_share": (step - forward) / step,  # goal: <= 3% at batch 32
        "core_share": core / step,
        "rpc_share": (step - forward - core) / step,
    }


def run_span(records: list[RequestRecord]) -> float:
    """The run's span over every request sent: the first scheduled arrival to the last end of
    any request, ok or failed (one that never ended counts to its scheduled time)."""
    if not records:
        return 0.0
    last = max(r.scheduled_s if r.end_s is None else r.end_s for r in records)
    return last - min(r.scheduled_s for r in records)


def error_reasons(errors: list[str]) -> dict[str, int]:
    """How many failures of each kind, most first: a gRPC status code (`DEADLINE_EXCEEDED`),
    `not sent` (an earlier turn failed), or the error's text up to its first colon."""
    reasons = Counter(_reason(e) for e in errors)
    return dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))


def _reason(error: str) -> str:
    if error.startswith("not sent"):
        return "not sent"
    head = error.split(":", 1)[0].strip()
    return head[:40] or "error"


def _gaps(records: list[RequestRecord]) -> np.ndarray:
    parts = [np.asarray(r.token_gaps) for r in records if r.token_gaps]
    return np.concatenate(parts) if parts else np.empty(0)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None
