"""`llmserve status` as text: the snapshot a person reads (the CLI and the demo print it)."""

from __future__ import annotations

from scheduler_svc.reasons import StallReason

REASONS = {r.value: r.description for r in StallReason}


def format_status(s: dict, explain: bool = False) -> str:
    """The snapshot; with `explain`, the head's explanation (or why there is none) after it."""
    head = s["head_wait_reason"]
    withheld = s.get("cache_figures_withheld", False)
    lines = [
        f"model {s['model']}  policy {s['policy']}  mode {s['mode']}  budget {s['token_budget']}"
        f"  max running {s['max_running']}  block size {s['block_size']}"
        f"  chunked prefill {'on' if s['chunked_prefill'] else 'off'}"
        f"  overlap {'on' if s['overlap'] else 'off'}"
        f"  prefix caching {'on' if s['prefix_caching'] else 'off'}"
        + time_budget_text(s)
        + decode_steps_text(s)
        + speculative_text(s),
        f"steps {s['steps']}  admitted {s['admitted']}  finished {s['finished']}"
        f"  preemptions {s['preemptions']}" + potential_text(s),
        f"waiting {s['waiting']} ({s['waiting_tokens']} tokens, oldest {s['oldest_wait_s']:.2f} s)"
        f"  running {s['running']}",
        f"head of queue waits: {head} ({REASONS.get(head, '')})"
        if head
        else "head of queue waits: "
        + (
            "not yet planned (it came after the last step was planned; the next one decides)"
            if s["waiting"]
            else "nothing waits"
        ),
        f"workers ({len(s['workers'])}), KV in positions:",
    ]
    for w in s["workers"]:
        state = "" if w["healthy"] else "  UNHEALTHY"
        state += "  DRAINING" if w["draining"] else ""
        stalls = ", ".join(f"{k} {v}" for k, v in sorted(w["stalls"].items()))
        lines.append(
            f"  {w['name']:<10} {w['address']:<21} block {w['block_size']:>3}  "
            f"context {w['max_context']:>6}  steps {w['steps']:>7}{state}\n"
            f"  {'':<10} capacity {w['capacity']:>7}  written {w['written']:>7}  "
            f"reserved-unwritten {w['reserved_unwritten']:>7}  free {w['free']:>7}  "
            f"running {w['running']}"
            + (f"  stalls: {stalls}" if stalls else "")
            + (f"\n  {'':<10} kernels: {w['kernels']}" if w.get("kernels") else "")
            + step_time_text(w)
            + (
                f"\n  {'':<10} prefix cache: cached blocks {w['cached_blocks']:>6}  evictable "
                f"{w['evictable_blocks']:>6}  hit rate {hit_rate(w):>6}  evictions "
                f"{w['evictions']}"
                if s["prefix_caching"] and not withheld
                else ""
            )
        )
    stalls = ", ".join(f"{k} {v}" for k, v in sorted(s["stalls"].items())) or "none"
    refused = ", ".join(f"{k} {v}" for k, v in sorted(s["refused"].items())) or "none"
    lines += [
        prefix_cache_line(s),
        f"admission stalls by reason (steps): {stalls}",
        f"refused at submit: {refused}",
    ]
    lines += cells_lines(s)
    if explain or s.get("explanation") or s.get("explanation_withheld"):
        lines.append(explanation_text(s))
    return "\n".join(lines)


def time_budget_text(s: dict) -> str:
    budget = s.get("step_time_budget_ms", 0.0)
    return f"  step-time budget {budget:g} ms{held_over(s)}" if budget else ""


def decode_steps_text(s: dict) -> str:
    """--decode-steps: executions per step when a worker only decodes and nothing waits."""
    runs = s.get("decode_steps", 1)
    if runs <= 1:
        return ""
    line = f"  decode steps up to {runs} per step ({s.get('run_steps', 0)} such steps)"
    if s.get("decode_runs", "fixed") == "auto":
        line += (
            f", auto: loop {s.get('loop_overhead_ms', 0.0):.2f} ms a step beside the forward,"
            f" {s.get('arrivals_per_s', 0.0):.1f} arrivals/s"
        )
    return line


def speculative_text(s: dict) -> str:
    """--speculative: the proposer, the longest draft, and how the drafts have done (vLLM's
    acceptance rate and mean acceptance length)."""
    mode = s.get("speculative", "off") or "off"
    if mode == "off" and not s.get("spec_drafts"):
        return ""
    drafts, drafted = s.get("spec_drafts", 0), s.get("spec_draft_tokens", 0)
    accepted = s.get("spec_accepted_tokens", 0)
    rate = f"{accepted / drafted:.0%}" if drafted else "-"
    length = f"{1 + accepted / drafts:.2f}" if drafts else "-"
    return (
        f"  speculative {mode} (up to {s.get('num_speculative_tokens', 0)}, "
        f"{s.get('speculative_length', 'auto')}; {drafts} drafts, acceptance {rate}, "
        f"mean length {length})"
    )


def potential_text(s: dict) -> str:
    """--speculation-potential: the tokens a step would emit on the finished requests' outputs,
    by prompt lookup and by the oracle (empty before any replay)."""
    figures = s.get("spec_potential") or {}
    parts = []
    for name, label in (("ngram", "prompt lookup"), ("oracle", "oracle")):
        r = figures.get(name)
        if not r or not r["steps"]:
            continue
        share = r["accepted_tokens"] / r["tokens"] if r["tokens"] else 0.0
        speed = ""
        if r.get("step_seconds") and r.get("plain_seconds"):
            speed = f", {r['plain_seconds'] / r['step_seconds']:.2f}x decode speed at one stream"
        parts.append(
            f"{label} {r['tokens'] / r['steps']:.2f} tokens/step ({share:.0%} drafted{speed})"
        )
    if not parts:
        return ""
    requests = figures.get("ngram", {}).get("requests", 0)
    return (
        f"\n  speculation would give, on {requests} finished requests (by the workers' step-time "
        "models): " + "; ".join(parts)
    )


def held_over(s: dict) -> str:
    """How the step-time budget holds, of a Status or an explanation: each step, or on average
    over a window of steps (--step-time-window)."""
    window = s.get("step_time_window", 1)
    return f" on average over {window} steps" if window > 1 else ""


def step_time_text(w: dict) -> str:
    """A worker's step-time model: its last step predicted and measured, its recent error."""
    if not w.get("step_time_error_steps"):
        return ""
    return (
        f"\n  {'':<10} step time: last predicted {1e3 * w['last_predicted_seconds']:.1f} ms, "
        f"measured {1e3 * w['last_forward_seconds']:.1f} ms; prediction error p50 "
        f"{100 * w['step_time_error_p50']:.0f}%  p90 {100 * w['step_time_error_p90']:.0f}% "
        f"(last {w['step_time_error_steps']} steps)"
    )


def cells_lines(s: dict) -> list[str]:
    """With a gateway of several cells: each cell, as the gateway routes to it (the figures
    above are the first cell's)."""
    cells = s.get("cells") or []
    if not cells:
        return []
    withheld = s.get("cache_figures_withheld", False)
    lines = [f"cells ({len(cells)}; the figures above are the first's), as the gateway routes:"]
    for c in cells:
        routed = ", ".join(f"{k} {v}" for k, v in sorted(c["routed"].items()) if v) or "none"
        hits = "" if withheld else f"  hit rate {hit_rate(c):>6}"
        lines.append(
            f"  {c['address']:<21} {'up' if c['up'] else 'DOWN':<4}  load {c['load']:>9.0f}  "
            f"waiting {c['waiting']:>4}  running {c['running']:>4}{hits}  routed: {routed}"
        )
    return lines


def hit_rate(figures: dict) -> str:
    """Prompt tokens served from the prefix cache / prompt tokens; "-" before any."""
    if not figures["prompt_tokens"]:
        return "-"
    return f"{100 * figures['hit_tokens'] / figures['prompt_tokens']:.1f}%"


CACHE_WITHHELD = (
    "prefix cache: on (its figures are for the operator: ask with --admin-key-file or the "
    "internal token, or read the scheduler's /metrics)"
)


def explanation_text(s: dict) -> str:
    """`llmserve status --explain`: what the head needs, who holds the room, what would admit
    it (each answer is the core's own, planned on a copy of it)."""
    e = s.get("explanation")
    if e is None:
        return (
            "explain: withheld (it names other clients' requests): ask with --admin-key-file"
            if s.get("explanation_withheld")
            else "explain: nothing waits"
        )
    reason = e["reason"]
    budget = (
        "static batching: no token budget"
        if e["budget_left"] < 0
        else f"{e['budget_left']} left of the token budget"
    )
    lines = [
        f"explain: head {e['request_id']} waits {e['wait_s']:.2f} s: "
        + (f"{reason} ({REASONS.get(reason, '')})" if reason else "admitted at the next step"),
        f"  needs: {e['tokens']} prompt tokens ({budget}), "
        f"{e['positions']} KV positions ({e['blocks']} blocks) on {e['worker']}, "
        f"a running slot ({e['running']} of {e['max_running']} running)",
    ]
    for w in e["workers"]:
        held = ", ".join(f"{rid} {n}" for rid, n in w["holders"])
        lines.append(
            f"  {w['name']}: free {w['free']}  written {w['written']}  reserved-unwritten "
            f"{w['reserved_unwritten']}  running {w['running']}"
            + (f"; reserved and unwritten by {held}" if held else "")
        )
    if e.get("step_time_budget_ms"):
        lines.append(time_budget_line(e))
    lines.append("  would admit it: " + "; ".join(counterfactuals(e)))
    lines += order_lines(e)
    return "\n".join(lines)


STANDING_ORDER = ("tenant", "priority", "slo_class", "counter", "weight", "deadline_s")


def _standing(s: dict) -> str:
    """A request and what orders it, in a fixed order (the wire's map keeps none)."""
    fields = s["standing"]
    keys = [k for k in STANDING_ORDER if k in fields] + sorted(set(fields) - set(STANDING_ORDER))
    shown = ", ".join(f"{k} {fields[k]}" for k in keys)
    return f"{s['request_id']} ({shown})"


def order_lines(e: dict) -> list[str]:
    """Who is ahead of whom in the queue's ordering, and what orders them."""
    if not e.get("head_standing"):
        return []
    lines = [f"  order: {e['queue_policy']}; the head is {_standing(e['head_standing'])}"]
    oldest = e.get("oldest")
    if oldest:
        ahead = "; ".join(_standing(s) for s in e.get("ahead", []))
        lines.append(
            f"  the oldest, {_standing(oldest)}, waits {oldest['wait_s']:.2f} s behind: {ahead}"
        )
    return lines


def time_budget_line(e: dict) -> str:
    """What the running work takes of the step-time budget on the head's worker."""
    budget, planned = e["step_time_budget_ms"], e.get("step_predicted_ms", -1)
    window, limit, held = e.get("step_time_window", 1), e.get("step_limit_ms", -1), held_over(e)
    if planned < 0:
        return f"  step-time budget {budget:g} ms{held}; {e['worker']} has no step planned"
    if window > 1:  # a step is planned: its limit is set
        left = f"may take {limit:.1f} ms" if limit > 0 else "has no time left beyond its decodes"
        before = "its last step" if window == 2 else f"its last {window - 1} steps"
        return (
            f"  step-time budget {budget:g} ms{held}: {e['worker']}'s next step {left} (what "
            f"{before} left of {window * budget:g} ms); as planned, without the head, it is "
            f"predicted at {planned:.1f} ms"
        )
    return (
        f"  step-time budget {budget:g} ms; {e['worker']}'s step as planned, without the head, "
        f"is predicted at {planned:.1f} ms ({planned / budget:.0%} of the budget)"
    )


def counterfactuals(e: dict) -> list[str]:
    after = e["after_request_id"]
    out = [
        f"{e['other_policy']}: {'yes, now' if e['admitted_under_other_policy'] else 'no'}",
        f"token budget {e['token_budget']}" if e["token_budget"] else "no token budget alone",
        f"running limit {e['running_limit']}" if e["running_limit"] else "no running limit alone",
    ]
    if e.get("step_time_budget_ms"):
        out.append(
            f"step-time budget {e['time_budget_ms']:g} ms"
            if e.get("time_budget_ms")
            else "no step-time budget alone"
        )
    after_text = f"{after} finishing (within {e['after_steps']} steps)" if after else ""
    return [*out, after_text or "no single finish"]


def prefix_cache_line(s: dict) -> str:
    """The cache's figures; only that it is on where they were withheld (an ordinary client's
    Status through the gateway: they would tell it of other clients' prompts)."""
    if not s["prefix_caching"]:
        return "prefix cache: off"
    if s.get("cache_figures_withheld"):
        return CACHE_WITHHELD
    return (
        f"prefix cache: hit rate {hit_rate(s)} ({s['hit_tokens']} of {s['prompt_tokens']} "
        f"prompt tokens served from cache)  evictions {s['evictions']}"
    )
