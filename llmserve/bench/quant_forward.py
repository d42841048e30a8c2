"""Our worker's step times for each --quantization side by side with bf16 (none), in one run.

python -m llmserve.bench.worker_forward --quantization none,int4,auto [--batches 1,8,64]
    [--prefill 128] [--reps 10] [--threads 2]

auto runs the int4 kernel for matmuls up to the CPU's row figure and the bf16 values above
(worker_svc/cpu_features.py: QUANTIZED_MAX_ROWS, BLOCKED_INT4_MAX_ROWS); the table names the
figure and the layer matrices each mode holds in memory (quantized codes, dense copies, oneDNN's
packed copies). A mode ending in "@torch" (int4@torch, auto@torch) runs torch's int4 and int8
kernels where this project's own (worker_svc/blocked_matmul.py) would run:

python -m llmserve.bench.worker_forward --quantization none,auto@torch,auto --batches 1,6,64

A mode ending in "@noamx" (auto@noamx) keeps the many-row int4 matmuls off the AMX tiles
(LLMSERVE_AMX_KERNELS=0: the blocked kernel and the dense copy, as before the AMX kernel):

python -m llmserve.bench.worker_forward --quantization auto@noamx,auto --batches 1,8,16,64

A mode ending in "@a8" (auto@a8) runs the int4 matmuls on int8 activations (--int4-activations
int8, VNNI), split by rows as the worker would split them so:

python -m llmserve.bench.worker_forward --ours-only --quantization auto,auto@a8 --batches 1,6,64

Every mode is loaded once and the cases run interleaved (A B C A B C ...), so load from other
processes on a shared host hits all modes alike; the figures are medians, the ratios bf16's time
over the mode's (above 1: the mode is faster). The host's CPU flags are printed with the table:
compare only within one run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager

import torch

from llmserve.bench.forward_timing import Ours, median_ms
from worker_svc import blocked_matmul
from worker_svc.cpu_features import host_features
from worker_svc.linear import Linear, QuantizedLinear
from worker_svc.loader import load_model
from worker_svc.weights import Weights, matrices


def cpu_line() -> str:
    cpu = host_features()

    def split(rows: int | None) -> str:
        return f"up to {rows} rows" if rows else "at every size"

    amx = (
        f", with AMX tiles from {blocked_matmul.amx_rows()} rows "
        f"{split(cpu.int4_max_rows(True, True))}"
        if blocked_matmul.amx_rows()
        else ""
    )

    return (
        f"cpu {cpu.model or '?'}: {cpu.tier} ({cpu.flag_text()}; torch "
        f"{torch.backends.cpu.get_cpu_capability()}); auto's int4 kernel: torch's "
        f"{split(cpu.int4_max_rows(False))}, this project's (where it runs) "
        f"{split(cpu.int4_max_rows(True))}{amx}"
    )


SUFFIXES = {"@torch": "LLMSERVE_BLOCKED_KERNELS", "@noamx": "LLMSERVE_AMX_KERNELS"}
A8 = "@a8"  # the int4 matmuls on int8 activations (--int4-activations int8)


@contextmanager
def int4_kernel(mode: str):
    """Loads a mode "x@torch" with torch's quantized kernels (LLMSERVE_BLOCKED_KERNELS=0), a
    mode "x@noamx" without the AMX int4 kernel (LLMSERVE_AMX_KERNELS=0), a mode "x@a8" with
    int8 activations (its linears split as the worker's would be; run it through
    `with_activations`)."""
    if mode.endswith(A8):
        with activations_of(mode):
            yield mode.removesuffix(A8)
        return
    suffix = next((s for s in SUFFIXES if mode.endswith(s)), None)
    if suffix is None:
        yield mode
        return
    name = SUFFIXES[suffix]
    before = os.environ.get(name)
    os.environ[name] = "0"
    try:
        yield mode.removesuffix(suffix)
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextmanager
def activations_of(mode: str):
    """Runs the body with the int4 activations its mode names (int8 for "x@a8"), then bf16."""
    blocked_matmul.set_activations("int8" if mode.endswith(A8) else "bf16")
    try:
        yield
    finally:
        blocked_matmul.set_activations("bf16")


def with_activations(mode: str, fn: Callable[[], object]) -> Callable[[], object]:
    """fn with the int4 activations its mode names (int8 for "x@a8", else bf16) set before each
    call: modes with and without side by side in one process, interleaved."""
    kind = "int8" if mode.endswith(A8) else "bf16"

    def run() -> object:
        blocked_matmul.set_activations(kind)
        return fn()

    return run


def held_bytes(ours: Ours) -> int:
    """Bytes of the layer matrices the model's linears hold, each tensor once."""
    held: dict[int, int] = {}
    for layer in ours.runner.model.linears:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            for t in held_tensors(lin):
                held[id(t)] = t.nbytes
    return sum(held.values())


def held_tensors(lin: Linear | QuantizedLinear) -> list:
    if isinstance(lin, QuantizedLinear):
        return [lin.weight, *(held_tensors(lin.dense) if lin.dense is not None else [])]
    return [t for t in (lin.weight, lin.packed) if t is not None]


def bytes_per_decode_step(weights: Weights) -> int:
    """What a batch-1 decode step reads: every layer matrix and the output matrix once (as int8
    where it is kept so: auto); of the embedding only one row."""
    head = weights.lm_head_int8 if weights.lm_head_int8 is not None else weights.lm_head
    return head.nbytes + sum(m.nbytes for lw in weights.layers for m in matrices(lw))


def quantization_table(
    source: str,
    modes: list[str],
    batches: list[int],
    prefill: int,
    context: int,
    reps: int,
) -> None:
    modes = ["none", *(m for m in modes if m != "none")]
    runs, read = [], []
    for mode in modes:
        with int4_kernel(mode) as plain:
            config, weights = load_model(source, torch.bfloat16, plain)
            runs.append(Ours(config, weights, torch.bfloat16, max(batches), context))
        read.append(bytes_per_decode_step(weights))
    print(
        f"{config.name}  bf16 activations  threads={torch.get_num_threads()}  context={context}  "
        f"reps={reps}\n{cpu_line()}"
    )
    print("weights read per decode step: " + "  ".join(
        f"{m} {r / 1e6:.0f} MB" for m, r in zip(modes, read, strict=True)
    ))  # fmt: skip
    print("layer matrices held: " + "  ".join(
        f"{m} {held_bytes(o) / 1e6:.0f} MB" for m, o in zip(modes, runs, strict=True)
    ))  # fmt: skip
    head = "".join(f"{m + ' ms':>11}" for m in modes)
    ratios = "".join(f"{'x ' + m:>9}" for m in modes[1:])
    print(f"{'case':<14}{head}  {ratios}")
    prompt = torch.randint(
        0, config.vocab_size, (prefill,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    cases = [(f"decode @{b}", lambda o, b=b: o.decode(b)) for b in batches]
    cases.append((f"prefill {prefill}", lambda o: o.prefill(prompt)))
    for name, make in cases:
        times = median_ms(
            [with_activations(m, make(o)) for m, o in zip(modes, runs, strict=True)], reps
        )
        cells = "".join(f"{t:>11.1f}" for t in times)
        speedups = "".join(f"{times[0] / t:>8.2f}x" for t in times[1:])
        print(f"{name:<14}{cells}  {speedups}")
