"""How well the cost model's features predict the real worker's steps on shapes that mix decodes
and prompt chunks: fitted on half of them, scored on the other half.

python -m llmserve.bench.shape_fit [--quantization auto] [--shapes 70] [--threads 2]

Times `--shapes` random steps (seeded: decodes 0 to 64 at contexts 32 to 600, and with 40%
odds, or when there are no decodes, a prompt chunk of 16 to 512 tokens from position 0 or later)
through the worker's runner, each the fastest of `--passes` whole passes. Then fits the model
(non-negative least squares, weighted by 1/seconds, as `llmserve bench calibrate` does) on the
even-numbered shapes and scores the odd ones, and the other way round, and prints the held-out
p50 / p90 of |predicted - measured| / measured: with the five linear features alone, and with
the sixth (min(tokens, K)) for several K. `scheduler_svc/step_cost.py` uses K = SMALL_ROWS.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from llmserve.bench.calibrate import BLOCK, Probe, _work
from llmserve.bench.cost_model import nonnegative_lstsq

KNEES = (4, 8, 16, 32, 64)


def random_grid(count: int, seed: int = 1) -> list[Probe]:
    rng = random.Random(seed)
    grid = []
    for _ in range(count):
        decodes = rng.choice([0, 1, 1, 2, 4, 8, 16, 32, 64])
        context = rng.randint(32, 600)
        chunks: tuple[tuple[int, int], ...] = ()
        if decodes == 0 or rng.random() < 0.4:
            start = rng.choice([0, 0, rng.randint(16, 400)])
            chunks = ((start, rng.choice([16, 32, 64, 128, 256, 512])),)
        grid.append(Probe(decodes, context, chunks))
    return grid


def time_grid(grid: list[Probe], quantization: str, passes: int) -> list[float]:
    import torch

    from worker_svc.loader import load_model
    from worker_svc.runner import ModelRunner
    from worker_svc.work import GREEDY, WorkItem

    config, weights = load_model("smollm2", torch.bfloat16, quantization)
    blocks = max(p.positions for p in grid) // BLOCK + 1
    runner = ModelRunner(config, weights, blocks, BLOCK, torch.bfloat16)
    batches = [_work(p, WorkItem, lambda: GREEDY) for p in grid]
    best = [float("inf")] * len(grid)
    for rep in range(passes + 1):  # pass 0 warms up
        for i, work in enumerate(batches):
            started = time.perf_counter()
            runner.execute(work)
            if rep:
                best[i] = min(best[i], time.perf_counter() - started)
    return best


def features(grid: list[Probe], knee: int) -> np.ndarray:
    """The five linear features (fixed, tokens, sampled, kv_read, attention), and min(tokens,
    knee) when knee > 0."""
    from scheduler_svc.step_cost import BatchShape

    rows = []
    for probe in grid:
        shape = BatchShape.of(probe.items())
        row = shape.vector()[:-1]  # the model's own, less its min(tokens, SMALL_ROWS)
        rows.append(row + ([min(shape.tokens, knee)] if knee else []))
    return np.array(rows, dtype=float)


def held_out_errors(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    index = np.arange(len(y))
    errors = []
    for fold in (0, 1):
        train, test = index % 2 != fold, index % 2 == fold
        coef = nonnegative_lstsq(x[train], y[train])
        errors.append(np.abs(x[test] @ coef - y[test]) / y[test])
    return np.concatenate(errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--shapes", type=int, default=70)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    from llmserve.bench.quant_forward import cpu_line

    torch.set_num_threads(args.threads)
    grid = random_grid(args.shapes)
    seconds = np.array(time_grid(grid, args.quantization, args.passes))
    print(f"{len(grid)} shapes, --quantization {args.quantization}, threads {args.threads}")
    print(cpu_line())
    print(f"{'features':<28}{'held-out p50':>14}{'p90':>8}")
    for knee in (0, *KNEES):
        errors = held_out_errors(features(grid, knee), seconds)
        name = "five linear" if not knee else f"+ min(tokens, {knee})"
        p50, p90 = np.percentile(errors, 50) * 100, np.percentile(errors, 90) * 100
        print(f"{name:<28}{p50:>13.1f}%{p90:>7.1f}%")


if __name__ == "__main__":
    main()
