"""`make demo`: the whole stack with SmolLM2 on loopback, a real workload, readable results.

1. Concurrent chat requests, streamed, under paged KV and continuous batching.
2. The seed's Figure 4 under both KV policies (capacity 24, block size 1, budget 8).
3. A burst of chat requests with a generous max_tokens under both policies: reservations
   hold the pool while the KV actually written stays low; paged lets everyone in.
4. Control: Figure 4 under reserve, `llmserve status --explain` while C waits, then
   `llmserve set policy=paged` live: C joins at the next step (docs/control-plane.md).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmserve import client
from llmserve.client import status_dict
from llmserve.demo_live import SIM_STEP_MS, figure4_switch
from llmserve.demo_questions import QUESTIONS
from llmserve.stack import Stack, StackSettings
from llmserve.status_text import REASONS, explanation_text, format_status

console = Console(highlight=False, width=None if Console().is_terminal else 120)


def native_bf16() -> bool:
    """Does this CPU compute bf16 natively (AVX-512 BF16)? Without it torch emulates bf16
    matmuls with another rounding: slower, and SmolLM2's greedy answers drift from fp32's
    (docs/figures.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_bf16" in f.read()
    except OSError:
        return False


DTYPE = "bf16" if native_bf16() else "fp32"
BASE = StackSettings(gateway_port=50351, scheduler_port=50352, worker_base_port=50361, dtype=DTYPE)


@dataclass
class Outcome:
    text: str = ""
    tokens: int = 0
    finish: str = ""
    queue: float = 0.0
    ttft: float = 0.0
    total: float = 0.0
    error: str = ""
    ids: list[int] = field(default_factory=list)


def ask(target: str, request, out: Outcome, on_delta=None) -> None:
    try:
        for message in client.stream(target, request, timeout=600):
            if message.HasField("delta"):
                out.text += message.delta.text
                out.ids += message.delta.token_ids
                if on_delta:
                    on_delta(message.delta.text)
            else:
                u = message.final.usage
                out.finish = client.FINISH_NAMES[message.final.finish_reason]
                out.tokens, out.queue = u.completion_tokens, u.queue_time_s
                out.ttft, out.total = u.time_to_first_token_s, u.total_time_s
    except Exception as err:  # noqa: BLE001 - shown to the user
        out.error = str(err)


def concurrently(target: str, requests: list) -> list[Outcome]:
    outs = [Outcome() for _ in requests]
    threads = [
        threading.Thread(target=ask, args=(target, r, o))
        for r, o in zip(requests, outs, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def part1(log_dir: Path) -> bool:
    console.rule(
        f"[bold]1. Concurrent chat requests (SmolLM2-135M-Instruct {DTYPE}, paged, continuous)"
    )
    with Stack(BASE, log_dir / "part1") as stack:
        target = stack.settings.gateway
        requests = [
            client.make_request(messages=[("user", q)], max_tokens=48, temperature=0.0)
            for q in QUESTIONS
        ]
        first = Outcome()
        console.print(f"[bold]> {QUESTIONS[0]}[/bold]  (streamed live; 3 more run alongside)")
        live = threading.Thread(
            target=ask, args=(target, requests[0], first, lambda d: console.out(d, end=""))
        )
        live.start()
        others = concurrently(target, requests[1:])
        live.join()
        console.print()
        table = Table("question", "answer", "tokens", "finish", "queue s", "TTFT s", "total s")
        for q, o in zip(QUESTIONS, [first, *others], strict=False):
            table.add_row(
                q,
                o.text.strip() or o.error,
                str(o.tokens),
                o.finish,
                f"{o.queue:.3f}",
                f"{o.ttft:.3f}",
                f"{o.total:.2f}",
            )
        console.print(table)
        console.print(format_status(status_dict(client.status(stack.settings.scheduler))))
    return "Paris" in first.text and all(o.finish for o in [first, *others])


def figure4(policy: str, log_dir: Path) -> dict:
    # the seed's order (no overlap): with overlap, KV is allocated one step ahead and B + C
    # would just exceed 24 positions at C's last step (docs/control-plane.md)
    settings = replace(
        BASE, policy=policy, kv_capacity=24, block_size=1, token_budget=8, overlap=False
    )
    prompt = " a b c d e f"  # six tokens
    with Stack(settings, log_dir / f"fig4-{policy}") as stack:
        b, c = Outcome(), Outcome()
        req_b = client.make_request(prompt=prompt, max_tokens=14, temperature=0.0, ignore_eos=True)
        req_c = client.make_request(prompt=prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        tb = threading.Thread(target=ask, args=(stack.settings.gateway, req_b, b))
        tb.start()
        while client.status(stack.settings.scheduler).running == 0:
            time.sleep(0.002)
        tc = threading.Thread(target=ask, args=(stack.settings.gateway, req_c, c))
        tc.start()
        waiting_view = None
        while tc.is_alive():
            s = status_dict(client.status(stack.settings.scheduler))
            if s["head_wait_reason"] and waiting_view is None:
                waiting_view = s
            time.sleep(0.005)
        tb.join()
        final = status_dict(client.status(stack.settings.scheduler))
    return {"b": b, "c": c, "waiting_view": waiting_view, "final": final}


def part2(log_dir: Path) -> bool:
    console.rule("[bold]2. The seed's Figure 4: KV capacity 24, block size 1, budget 8")
    console.print(
        "B (6 prompt tokens, max_tokens 14: 20 positions) is decoding; C (6 prompt tokens) arrives."
    )
    runs = {p: figure4(p, log_dir) for p in ("reserve", "paged")}
    for policy, r in runs.items():
        console.print(
            f"\n[bold]{policy}[/bold]: C waited {r['c'].queue * 1000:.0f} ms "
            f"before joining a batch; stalls {r['final']['stalls'] or 'none'}"
        )
        if r["waiting_view"]:
            console.print("  while C waited, `llmserve status` showed:")
            console.print("  " + format_status(r["waiting_view"]).replace("\n", "\n  "))
    reserve, paged = runs["reserve"], runs["paged"]
    return bool(reserve["final"]["stalls"].get("kv_reserved")) and not paged["final"]["stalls"]


def burst(policy: str, log_dir: Path) -> tuple[list[Outcome], dict, float, int]:
    settings = replace(BASE, policy=policy, kv_capacity=2048, block_size=16, token_budget=256)
    prompts = [f"{q} Answer briefly." for q in QUESTIONS * 3]
    with Stack(settings, log_dir / f"burst-{policy}") as stack:
        requests = [
            client.make_request(messages=[("user", p)], max_tokens=400, temperature=0.0)
            for p in prompts
        ]
        peak = {"written": 0}
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                kv = client.status(stack.settings.scheduler).workers[0]
                peak["written"] = max(peak["written"], kv.written)
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        started = time.monotonic()
        outs = concurrently(stack.settings.gateway, requests)
        elapsed = time.monotonic() - started
        done.set()
        watcher.join()
        final = status_dict(client.status(stack.settings.scheduler))
    return outs, final, elapsed, peak["written"]


def part3(log_dir: Path) -> bool:
    console.rule("[bold]3. A burst of 12 chat requests, max_tokens 400, KV capacity 2048")
    table = Table(
        "policy",
        "wall s",
        "output tok/s",
        "mean queue s",
        "max queue s",
        "peak KV written",
        "stalls by reason",
    )
    runs = {}
    for policy in ("reserve", "paged"):
        outs, final, elapsed, peak = burst(policy, log_dir)
        runs[policy] = final
        tokens = sum(o.tokens for o in outs)
        queues = [o.queue for o in outs]
        table.add_row(
            policy,
            f"{elapsed:.1f}",
            f"{tokens / elapsed:.0f}",
            f"{sum(queues) / len(queues):.2f}",
            f"{max(queues):.2f}",
            f"{peak} / 2048",
            ", ".join(f"{k} {v}" for k, v in final["stalls"].items()) or "none",
        )
    console.print(table)
    console.print(
        "Under reserve each request sets aside prompt + 400 positions, so only a few "
        "run at once although the KV actually written stays far below capacity."
    )
    for reason, meaning in REASONS.items():
        console.print(f"  {reason:<13} {meaning}")
    return runs["reserve"]["stalls"].get("kv_reserved", 0) > 0


def part4(log_dir: Path) -> bool:
    console.rule("[bold]4. Control: Figure 4 under reserve, explained, then switched to paged live")
    console.print(
        f"B (6 + 14 reserved) decodes, C (6 + 6) waits; simulated steps of {SIM_STEP_MS:g} ms."
    )
    run = figure4_switch(BASE, log_dir / "live-switch")
    console.print("$ llmserve status --explain   (while C waits)")
    console.print("  " + explanation_text({"explanation": run.explanation}).replace("\n", "\n  "))
    console.print("$ llmserve set policy=paged")
    for name, (old, new) in run.changed.items():
        console.print(f"  {name}: {old} -> {new}")
    kept = run.stalls_after == run.stalls_before
    since = "none since: C joined at the next step" if kept else "more since"
    console.print(
        f"C seen admitted {run.steps_to_admit} step(s) after the change; stalls at the change "
        f"{run.stalls_before or 'none'}, at the end {run.stalls_after or 'none'} ({since})"
    )
    return run.stalls_after == run.stalls_before


def run_demo(log_dir: Path) -> int:
    checks = {
        "1. chat answers (Paris)": part1(log_dir),
        "2. Figure 4": part2(log_dir),
        "3. burst": part3(log_dir),
        "4. live switch": part4(log_dir),
    }
    console.rule("[bold]summary")
    for name, ok in checks.items():
        console.print(f"{'ok  ' if ok else 'FAIL'} {name}")
    console.print(f"service logs: {log_dir}/")
    return 0 if all(checks.values()) else 1
