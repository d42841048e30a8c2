"""The served stack's output tokens/s at several concurrencies, and the worker's busy fraction
(forward time / wall) at the real step time, through real processes: a random model of a real
shape written as a model directory (llmserve.bench.gpu_models), served by one worker on the
device, under closed-loop streaming clients (llmserve.bench.overhead's load and Status window).

python -m llmserve.bench.gpu_served SHAPE DEVICE LEVELS WINDOW_S MAX_TOKENS DTYPE KV_CAPACITY
prints one JSON line last; a process of its own (a fresh gRPC state, the device's memory free).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from llmserve.bench.gpu_models import random_model, write_model_dir
from llmserve.bench.overhead import measure
from llmserve.ports import free_ports, free_run
from llmserve.stack import Stack, StackSettings

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WARMUP_S = 3.0  # at the largest level first: CUDA graphs are captured and kernels compiled


def served_settings(
    model_dir: Path, device: str, levels: list[int], dtype: str, kv_capacity: int
) -> StackSettings:
    ports = free_ports(2)
    return StackSettings(
        model=str(model_dir), dtype=dtype, device=device,
        gateway_port=ports[0], scheduler_port=ports[1], worker_base_port=free_run(1, ports),
        max_running=max(levels), kv_capacity=kv_capacity, token_budget=max(256, max(levels)),
        max_queued_requests=4 * max(levels),
    )  # fmt: skip


def run(
    shape: str, device: str, levels: list[int], window_s: float, max_tokens: int, dtype: str,
    kv_capacity: int,
) -> dict:  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        config, weights = random_model(shape, DTYPES[dtype], "cpu")
        model_dir = write_model_dir(config, weights, Path(tmp) / f"{shape}-random")
        del weights
        settings = served_settings(model_dir, device, levels, dtype, kv_capacity)
        loop = asyncio.new_event_loop()  # one loop for every level (grpc.aio takes one well)
        rows = {}
        logs = Path(tmp) / "logs"
        try:
            with Stack(settings, logs):
                loop.run_until_complete(measure(settings, max(levels), WARMUP_S, max_tokens))
                for level in levels:
                    row = loop.run_until_complete(measure(settings, level, window_s, max_tokens))
                    rows[str(level)] = level_figures(row, window_s)
        except Exception as error:
            # the error last: the caller keeps the end of this process's stderr
            raise RuntimeError(f"{log_tails(logs)}\n{error}") from error
    return {
        "shape": shape,
        "dtype": dtype,
        "device": device,
        "window_s": window_s,
        "max_tokens": max_tokens,
        "kv_capacity": kv_capacity or "sized from memory",
        "concurrency": rows,
    }


def level_figures(row, window_s: float) -> dict:
    """One concurrency's figures from its Status window (llmserve.bench.overhead.Row)."""
    return {
        "output_tok_s": round(row.tokens_per_s, 1),
        "received_tok_s": round(row.client_tokens_per_s, 1),
        "worker_busy": round(row.busy, 4),
        "step_ms": round(1e3 * window_s * row.busy / max(row.steps, 1), 3),
        "outside_forward_ms_per_step": round(row.outside_ms, 3),
        "steps": row.steps,
        # tokens per step: below the streams where some are between requests (client turnaround)
        "tokens_per_step": round(row.tokens_per_s * window_s / max(row.steps, 1), 1),
    }


def log_tails(logs: Path, lines: int = 15) -> str:
    """The last lines of each process's log (they go with the temporary directory)."""
    parts = []
    for log in sorted(logs.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name}\n" + "\n".join(tail))
    return "\n".join(parts)


def run_child(
    shape: str, device: str, levels: list[int], window_s: float, max_tokens: int, dtype: str,
    kv_capacity: int, timeout: float,
) -> dict:  # fmt: skip
    """run() in a process of its own; its JSON."""
    import subprocess

    args = [shape, device, ",".join(map(str, levels)), str(window_s), str(max_tokens), dtype]
    command = [sys.executable, "-m", "llmserve.bench.gpu_served", *args, str(kv_capacity)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the served run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    shape_, device_, levels_, window_, tokens_, dtype_, capacity_ = sys.argv[1:8]
    result = run(
        shape_, device_, [int(x) for x in levels_.split(",")], float(window_), int(tokens_),
        dtype_, int(capacity_),
    )  # fmt: skip
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # do not wait on gRPC's threads at exit
