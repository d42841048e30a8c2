"""Measure a live switch from reserve to paged under a burst (docs/control-plane.md, issue 23).

A stack of simulated workers (steps of --sim-step-ms, nothing computed) under `reserve` takes a
steady stream of requests with a generous max_tokens (400) whose answers are short (20 to 80
tokens), the demo's part 3 shape; halfway `llmserve set policy=paged` is applied live. The
scheduler's /metrics is scraped every 0.25 s: stalls per second and the head's wait (oldest
wait) over time; each request's queue time by when it arrived.

    .venv/bin/python scripts/live_switch.py [--out docs/benchmarks/live-switch.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from llmserve import client  # noqa: E402
from llmserve.ports import free_ports, free_run  # noqa: E402
from llmserve.stack import Stack, StackSettings  # noqa: E402

KEY = "live-switch-key"
EOS = 2  # the simulated model's stop token (SmolLM2's)


def scrape(port: int) -> tuple[float, float]:
    """(admission stalls so far, oldest wait s) from the scheduler's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    stalls = wait = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llmserve_scheduler_admission_stalls_total":
                stalls += sample.value
            elif sample.name == "llmserve_scheduler_oldest_wait_seconds":
                wait = sample.value
    return stalls, wait


def run(args: argparse.Namespace, log_dir: Path) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "admin.key").write_text(KEY)
    gw, sc = free_ports(2)
    settings = replace(
        StackSettings(),
        model="sim",
        sim_step_ms=args.step_ms,
        policy="reserve",
        kv_capacity=2048,
        block_size=16,
        token_budget=256,
        gateway_port=gw,
        scheduler_port=sc,
        worker_base_port=free_run(1, (gw, sc)),
        metrics_base_port=free_run(3, (gw, sc)),
        admin_key_file=str(log_dir / "admin.key"),
        max_queued_requests=1024,
    )
    arrivals: list[float] = []
    queues: list[float] = []
    samples: list[tuple[float, float, float]] = []
    with Stack(settings, log_dir) as stack:
        metrics_port = settings.metrics_port(1)
        start = time.monotonic()
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                stalls, wait = scrape(metrics_port)
                samples.append((time.monotonic() - start, stalls, wait))
                time.sleep(0.25)

        def ask(i: int) -> None:
            request = client.make_request(
                prompt=f"Request {i}: " + "tell me more " * 8, max_tokens=400, temperature=0.0
            )
            # answers far shorter than max_tokens, as chat answers are: the simulated model
            # ends each after 20 to 80 tokens (its stop token forced from then on)
            request.sampling.min_tokens = 20 + (i * 37) % 61
            request.sampling.logit_bias[EOS] = 100.0
            arrivals[i] = time.monotonic() - start
            for message in client.stream(stack.settings.gateway, request, timeout=600):
                if message.HasField("final"):
                    queues[i] = message.final.usage.queue_time_s

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        arrivals += [0.0] * args.requests
        queues += [0.0] * args.requests
        threads = []
        switch_at = None
        for i in range(args.requests):
            if switch_at is None and i >= args.requests // 2:
                with client.Client(stack.settings.gateway, admin_key=KEY, timeout=30) as c:
                    c.set_settings({"policy": "paged"})
                switch_at = time.monotonic() - start
            thread = threading.Thread(target=ask, args=(i,))
            thread.start()
            threads.append(thread)
            time.sleep(1 / args.rate)
        for thread in threads:
            thread.join()
        done.set()
        watcher.join()
    return {"switch_at": switch_at, "arrivals": arrivals, "queues": queues, "samples": samples}


def summary(r: dict) -> dict:
    at, samples = r["switch_at"], r["samples"]
    pairs = list(zip(r["arrivals"], r["queues"], strict=True))
    before = [q for a, q in pairs if a < at]
    after = [q for a, q in pairs if a >= at]
    first = next(s for s in samples if s[0] >= at)
    last = samples[-1]
    stalls_before = first[1] / first[0]
    stalls_after = (last[1] - first[1]) / (last[0] - first[0])
    return {
        "stalls_per_s": [round(stalls_before, 2), round(stalls_after, 2)],
        "queue_mean_s": [round(statistics.mean(before), 2), round(statistics.mean(after), 2)],
        "queue_max_s": [round(max(before), 2), round(max(after), 2)],
        "head_wait_max_s": [
            round(max(s[2] for s in samples if s[0] < at), 2),
            round(max(s[2] for s in samples if s[0] >= at + 1.0), 2),
        ],
    }


def plot(r: dict, path: Path) -> None:
    t = [s[0] for s in r["samples"]]
    rate = [0.0] + [
        (b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(r["samples"], r["samples"][1:], strict=False)
    ]
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    top.plot(t, rate)
    top.set_ylabel("admission stalls / s")
    mid.plot(t, [s[2] for s in r["samples"]])
    mid.set_ylabel("head's wait (s)")
    low.scatter(r["arrivals"], r["queues"], s=10)
    low.set_ylabel("queue time (s)")
    low.set_xlabel("seconds (requests by arrival)")
    for ax in (top, mid, low):
        ax.axvline(r["switch_at"], color="orange", linestyle="--")
    top.set_title("reserve, then llmserve set policy=paged (orange) under a steady burst")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--rate", type=float, default=5.0, help="arrivals per second")
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--out", default="docs/benchmarks/live-switch.png")
    parser.add_argument("--log-dir", default="results/live-switch")
    args = parser.parse_args()
    r = run(args, Path(args.log_dir))
    plot(r, Path(args.out))
    figures = summary(r)
    (Path(args.log_dir) / "live-switch.json").write_text(json.dumps(r | figures, indent=1))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
