"""`python -m llmserve.bench.forward_thread`: one OpenMP team or two, side by side.

A one-row decode step (SmolLM2 under `auto`, bf16, context 200) timed from the main thread,
then from a second thread after the main one has run parallel regions, then from the main
thread again: each thread that enters a parallel region gets a team of its own, and the second
team slows the first one's regions. Why the worker does all of its torch work on its forward
thread (worker_svc/service.py `forward_thread`; docs/benchmarks.md, "One thread for the model,
and decode runs"). Medians of --reps steps; the host's flags printed with them."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--source", default="smollm2")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from llmserve.bench.forward_timing import Ours
    from llmserve.bench.quant_forward import cpu_line
    from worker_svc.loader import load_model

    config, weights = load_model(args.source, torch.bfloat16, "auto")
    step = Ours(config, weights, torch.bfloat16, 1, 200).decode(1)

    def median_ms() -> float:
        for _ in range(10):
            step()
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    print(f"{cpu_line()}\n{args.threads} threads, one-row decode, median of {args.reps}")
    print(f"  {threading.current_thread().name} thread: {median_ms():.2f} ms", flush=True)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="second") as second:
        print(f"  a second thread: {second.submit(median_ms).result():.2f} ms", flush=True)
    print(f"  the main thread again: {median_ms():.2f} ms", flush=True)


if __name__ == "__main__":
    main()
