"""How much one fixed step shape's time spreads on this host: the real worker's runner (as
`llmserve worker` builds it), a few fixed shapes timed over and over, interleaved, with the clock
the worker reports its step time by. The spread is the floor of any step-time model's error: a
model that predicted each shape's median exactly would still be off by it.

    python -m llmserve.bench.step_noise --threads 1 --repeats 40
"""

from __future__ import annotations

import argparse
import json
import time

from llmserve.bench.calibrate import Probe, _work
from llmserve.bench.report import machine

SHAPES = {
    "1 decode @64": Probe(1, 64),
    "8 decodes @256": Probe(8, 256),
    "16 decodes @256": Probe(16, 256),
    "chunk 32 @0": Probe(chunks=((0, 32),)),
    "2 chunks 16 @0": Probe(chunks=((0, 16), (0, 16))),
    "8 decodes + chunk 24": Probe(8, 256, ((0, 24),)),
}
IDLE_S = 0.2  # the pause before the "after idle" timing of the first shape


def spread(times: list[float]) -> dict[str, float]:
    """Median and the quantiles of |t - median| / median: the error of predicting the median."""
    ranked = sorted(times)
    mid = ranked[len(ranked) // 2]
    dev = sorted(abs(t - mid) / mid for t in times)
    return {
        "median_ms": round(mid * 1e3, 2),
        "min_ms": round(ranked[0] * 1e3, 2),
        "max_ms": round(ranked[-1] * 1e3, 2),
        "dev_p50": round(dev[len(dev) // 2], 4),
        "dev_p90": round(dev[min(len(dev) - 1, int(0.9 * len(dev)))], 4),
    }


def measure(threads: int, repeats: int, model: str = "smollm2") -> dict:
    from worker_svc.__main__ import make_runner
    from worker_svc.settings import WorkerSettings
    from worker_svc.work import GREEDY, WorkItem

    runner = make_runner(WorkerSettings(model=model, threads=threads, kv_capacity=8192))
    batches = {name: _work(p, WorkItem, lambda: GREEDY) for name, p in SHAPES.items()}
    times: dict[str, list[float]] = {name: [] for name in [*SHAPES, "1 decode after idle"]}
    first = next(iter(batches.values()))
    for rep in range(repeats + 1):  # whole passes: a burst of noise lands on one pass
        for name, work in batches.items():
            started = time.perf_counter()
            runner.execute(work)
            if rep:  # pass 0 warms up
                times[name].append(time.perf_counter() - started)
        time.sleep(IDLE_S)
        started = time.perf_counter()
        runner.execute(first)
        if rep:
            times["1 decode after idle"].append(time.perf_counter() - started)
    return {"machine": machine(), "threads": threads, "repeats": repeats,
            "shapes": {name: spread(t) for name, t in times.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", default="", help="also write the figures here (JSON)")
    args = parser.parse_args()
    report = measure(args.threads, args.repeats, args.model)
    for name, s in report["shapes"].items():
        print(f"{name:22s} median {s['median_ms']:7.2f} ms  min {s['min_ms']:7.2f}  "
              f"max {s['max_ms']:8.2f}  |t-median|/median p50 {s['dev_p50']:.1%} "
              f"p90 {s['dev_p90']:.1%}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
