"""Measure the real worker's executions (ModelRunner.execute, what the worker reports as
forward_seconds) over a grid of batch shapes and fit the cost model to them.

The grid is timed in whole passes and each shape keeps its fastest time: on a machine shared with
other work, the minimum is the figure least disturbed by it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmserve.bench.cost_model import DEFAULT_COST_MODEL, BatchShape, CostModel, fit
from llmserve.bench.prompts import WORD_ID
from llmserve.bench.report import machine
from scheduler_svc.step_cost import SMALL_ROWS

BLOCK = 16


@dataclass(frozen=True, slots=True)
class Probe:
    """One batch shape to time: decodes at a context, plus prefill chunks (start, length)."""

    decodes: int = 0
    context: int = 0
    chunks: tuple[tuple[int, int], ...] = ()

    def items(self) -> list[tuple[int, int, bool]]:
        out = [(self.context - 1, 1, True) for _ in range(self.decodes)]
        return out + [(start, n, True) for start, n in self.chunks]

    @property
    def positions(self) -> int:
        return sum(_round_up(s + n) for s, n, _ in self.items())


def default_grid(quick: bool = False) -> list[Probe]:
    batches = [1, 8, 32] if quick else [1, 4, 16, 32, 64]
    contexts = [32, 512] if quick else [32, 256, 1024]
    grid = [Probe(b, c) for b in batches for c in contexts if b * c <= 32768]
    lengths = [64, 256] if quick else [32, 128, 256, 512]
    grid += [Probe(chunks=((s, n),)) for n in lengths for s in (0, 512)]
    grid += [Probe(16, 256, ((0, n),)) for n in ((128,) if quick else (128, 256))]
    return grid


def default_output(model: str, dtype_name: str, quantization: str) -> Path:
    """data/cost_models/MODEL-DTYPE[-QUANTIZATION]-cpu.json (none: no suffix, so that the
    committed smollm2-bf16-cpu.json, the simulator's default, is the bf16 calibration); a model
    given as a path is named by its file's stem."""
    name = Path(model).stem if ("/" in model or model.endswith(".gguf")) else model
    suffix = "" if quantization == "none" else f"-{quantization}"
    return DEFAULT_COST_MODEL.with_name(f"{name}-{dtype_name}{suffix}-cpu.json")


def measure(
    model: str,
    dtype_name: str,
    threads: int,
    grid: list[Probe],
    repeats: int = 5,
    log: Callable[[str], None] = print,
    quantization: str = "none",
) -> tuple[list[BatchShape], list[float]]:
    import torch

    from worker_svc.loader import load_model
    from worker_svc.runner import ModelRunner
    from worker_svc.work import GREEDY, WorkItem

    if threads:
        torch.set_num_threads(threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    config, weights = load_model(model, dtype, quantization)
    blocks = max(p.positions for p in grid) // BLOCK + 1
    runner = ModelRunner(config, weights, blocks, BLOCK, dtype)
    batches = [_work(probe, WorkItem, lambda: GREEDY) for probe in grid]
    best = [float("inf")] * len(grid)
    for rep in range(repeats + 1):  # whole passes, so that a burst of noise hits one pass only
        for i, work in enumerate(batches):
            started = time.perf_counter()
            runner.execute(work)
            if rep:  # pass 0 warms up
                best[i] = min(best[i], time.perf_counter() - started)
        log(f"  pass {rep}/{repeats} done")
    shapes = [BatchShape.of(probe.items()) for probe in grid]
    for probe, shape, seconds in zip(grid, shapes, best, strict=True):
        log(
            f"  {probe.decodes:3d} decodes @ {probe.context:5d} + chunks {list(probe.chunks)}: "
            f"{seconds * 1000:8.1f} ms  ({shape.tokens} tokens, kv_read {shape.kv_read})"
        )
    return shapes, best


def _work(probe: Probe, work_item, sampling) -> list:
    work, next_block = [], 0
    for i, (start, n, sample) in enumerate(probe.items()):
        need = _round_up(start + n) // BLOCK
        work.append(
            work_item(
                f"r{i}",
                [WORD_ID] * n,
                start,
                list(range(next_block, next_block + need)),
                sample,
                sampling(),
                0,
            )
        )
        next_block += need
    return work


def calibrate(
    model: str = "smollm2",
    dtype_name: str = "bf16",
    threads: int = 0,
    quick: bool = False,
    repeats: int = 5,
    log: Callable[[str], None] = print,
    quantization: str = "none",
) -> CostModel:
    """quantization: the weights as the worker to be predicted runs them (`llmserve up` and the
    worker default to auto: a GGUF's 4-bit matrices as int4 for a few rows)."""
    grid = default_grid(quick)
    log(
        f"timing {len(grid)} batch shapes of {model} ({dtype_name}, --quantization "
        f"{quantization}, threads {threads or 'all'})"
    )
    shapes, seconds = measure(model, dtype_name, threads, grid, repeats, log, quantization)
    meta = {
        "model": model,
        "dtype": dtype_name,
        "quantization": quantization,
        "threads": threads,
        "block_size": BLOCK,
        "measured": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "command": f"llmserve bench calibrate --model {model} --dtype {dtype_name} "
        f"--quantization {quantization} --threads {threads} --repeats {repeats}"
        + (" --quick" if quick else ""),
        "points": [
            [s.tokens, s.sampled, s.kv_read, s.attention, round(t, 6)]
            for s, t in zip(shapes, seconds, strict=True)
        ],
        "point_columns": ["tokens", "sampled", "kv_read", "attention", "seconds"],
    }
    return fit(shapes, seconds, meta)


def fit_summary(model: CostModel) -> str:
    """How well the fit holds and its coefficients, each in the unit that reads best."""
    fit = model.meta["fit"]
    return (
        f"fitted (R² {fit['r2']:.3f}, median error {fit['median_abs_rel_error']:.1%}): "
        f"fixed {model.fixed * 1e3:.2f} ms, per token {model.per_token * 1e3:.3f} ms, "
        f"per sampled row {model.per_sampled * 1e3:.3f} ms, per KV position read "
        f"{model.per_kv_read * 1e6:.3f} µs, per attention pair {model.per_attention * 1e9:.3f} "
        f"ns, per token of the first {SMALL_ROWS} {model.per_small_token * 1e3:.3f} ms"
    )


def _round_up(positions: int) -> int:
    return -(-positions // BLOCK) * BLOCK
