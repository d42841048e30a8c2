"""What the worker runs on this host, chosen at start and reported (log, Describe, status): the
CPU's tier (worker_svc.cpu_features), the dtype, the quantization and which matmul path serves
which rows, and the threads."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from worker_svc import cpu_kernels
from worker_svc.cpu_features import CpuFeatures, pick_threads, usable_cpus
from worker_svc.linear import QuantizedLinear, give_dense, packing_available
from worker_svc.quant import Int4Weight, dense_dtype

CANDIDATE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)  # measure_max_rows' candidates
DENSE_PATHS = {
    "amx": "oneDNN AMX",
    "avx512_bf16": "oneDNN AVX-512 BF16",
    "avx512_vnni": "oneDNN AVX-512",
    "avx512": "oneDNN AVX-512",
    "avx2": "oneDNN AVX2",
    "baseline": "oneDNN",
}


@dataclass(frozen=True, slots=True)
class KernelPlan:
    cpu: str  # the tier: amx, avx512_bf16, avx512_vnni, avx512, avx2, baseline
    cpu_flags: str  # of cpu_features.FLAGS, space-separated
    torch_capability: str  # torch.backends.cpu.get_cpu_capability(): AVX512, AVX2, DEFAULT
    dtype: str
    quantization: str
    kernel: str  # the layers' quantized kernel: int4, int8, or "" (none quantized)
    quantized_max_rows: int  # the quantized kernel up to this many rows, dense above; 0 = one path
    rows_from: str  # why: "cpu table", "measured", "--quantized-max-rows"
    threads: int
    device: str = "cpu"
    small_step_rows: int = 0  # steps of at most this many rows run on small_step_threads
    small_step_threads: int = 0
    output_int8_rows: int = 0  # the output matrix runs as int8 up to this many logit rows; 0: not
    output_kernel: str = "int8"  # which int8 kernel: "int8" (torch's) or "blocked int8" (ours)
    amx_from_rows: int = 0  # int4 matmuls of this many rows and more on AMX tiles; 0: never
    kv_cache: str = "auto"  # the KV pool's values (--kv-cache-dtype): auto (= dtype), int8

    def matmuls(self) -> str:
        """Which path serves which rows, in words."""
        if self.device != "cpu":
            return f"{self.dtype} torch on {self.device}"
        dense = f"bf16 {DENSE_PATHS[self.cpu]}" if self.dtype == "bf16" else f"{self.dtype} MKL"
        head = (
            f"; output {self.output_kernel} up to {self.output_int8_rows} rows"
            if self.output_int8_rows
            else ""
        )
        if not self.kernel:
            return dense + head
        why = f" ({self.rows_from})" if self.rows_from else ""
        kernel = self.kernel
        if self.amx_from_rows:
            kernel = f"{kernel} kernel up to {self.amx_from_rows - 1} rows, AMX int4 tiles"
        else:
            kernel += " kernel"
        if not self.quantized_max_rows:
            return f"{kernel} at every size{why}{head}"
        return f"{kernel} up to {self.quantized_max_rows} rows{why}, {dense} above{head}"

    def fields(self) -> dict:
        """The WorkerInfo (Describe) fields that report it."""
        return {
            "cpu": self.cpu,
            "cpu_flags": self.cpu_flags,
            "quantization": self.quantization,
            "quantized_max_rows": self.quantized_max_rows,
            "threads": self.threads,
            "kernels": self.summary(),
        }

    def thread_text(self) -> str:
        text = f"{self.threads} threads"
        if self.small_step_rows and self.small_step_threads not in (0, self.threads):
            text += f" ({self.small_step_threads} for steps of <= {self.small_step_rows} rows)"
        return text

    def summary(self) -> str:
        return (
            f"cpu {self.cpu} ({self.cpu_flags}; torch {self.torch_capability}), "
            f"{self.thread_text()}, quantization {self.quantization}: {self.matmuls()}"
            + ("; KV pool int8 (codes and a scale per position and KV head)"
               if self.kv_cache == "int8" else "")
        )  # fmt: skip


def plan_kernels(
    runner, cpu: CpuFeatures, dtype: str, quantization: str, asked_rows: int = 0
) -> KernelPlan:
    """The plan of a built runner; auto's 4-bit linears get their split (split_rows)."""
    model = runner.model
    quantized = quantized_linears(model.linears)
    splittable = [lin for lin in quantized if lin.weight.keep_dense]
    rows, source = split_rows(splittable, cpu, asked_rows, packing_available(model.dtype))
    head = model.lm_head if isinstance(model.lm_head, QuantizedLinear) else None
    return KernelPlan(
        cpu=cpu.tier,
        cpu_flags=cpu.flag_text(),
        torch_capability=torch.backends.cpu.get_cpu_capability(),
        dtype=dtype,
        quantization=quantization,
        kernel=kernel_name(quantized[0]) if quantized else "",
        quantized_max_rows=rows,
        rows_from=source,
        threads=torch.get_num_threads(),
        device=str(runner.device),
        output_int8_rows=head.max_rows if head is not None else 0,
        output_kernel=kernel_name(head) if head is not None else "int8",
        amx_from_rows=amx_from_rows(quantized),
        kv_cache=getattr(runner, "cache_dtype", "auto"),
    )


def amx_from_rows(quantized: list[QuantizedLinear]) -> int:
    """The rows from which the layers' int4 matmuls run on AMX tiles (0: they never do)."""
    return max((getattr(lin.weight, "amx_from_rows", 0) for lin in quantized), default=0)


def split_rows(
    splittable: list[QuantizedLinear], cpu: CpuFeatures, asked_rows: int, pack: bool
) -> tuple[int, str]:
    """The rows up to which the quantized kernel runs (0: at every size, no dense copy kept):
    asked_rows when > 0, measured when -1, else the CPU's table figure. Returns it and why."""
    if not splittable:
        return 0, ""
    if asked_rows > 0:
        rows, source = asked_rows, "--quantized-max-rows"
    elif asked_rows < 0:
        for lin in splittable:
            give_dense(lin, pack)
        rows, source = measure_max_rows(splittable)[0], "measured"
    else:
        blocked = any(lin.weight.blocked is not None for lin in splittable)
        a8 = isinstance(splittable[0].weight, Int4Weight) and splittable[0].weight.a8
        rows = cpu.int4_max_rows(blocked, amx_from_rows(splittable) > 0, a8) or 0
        source = "cpu table"
    for lin in splittable:
        if rows:
            give_dense(lin, pack)
            lin.max_rows = rows
        else:
            lin.dense = None  # one path: the dense copy's memory back
    return rows, source


def kernel_name(lin: QuantizedLinear) -> str:
    return lin.weight.kernel


def describe_fields(runner) -> dict:
    """A runner's plan as WorkerInfo fields (none for a runner without one: the simulated)."""
    plan = getattr(runner, "kernel_plan", None)
    return plan.fields() if plan is not None else {}


def quantized_linears(linears: Iterable) -> list[QuantizedLinear]:
    """The model's layer matrices run by a quantized kernel."""
    out = []
    for layer in linears:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if isinstance(lin, QuantizedLinear):
                out.append(lin)
    return out


def dual_linears(linears: Iterable) -> list[QuantizedLinear]:
    """Those that keep a dense form too (--quantization auto, split by rows)."""
    return [lin for lin in quantized_linears(linears) if lin.dense is not None]


def threads_for(cpu: CpuFeatures, asked: int) -> int:
    """--threads when given; else one per physical core of this process's CPUs."""
    if asked:
        return asked
    return pick_threads(torch.get_num_threads(), usable_cpus(), cpu.threads_per_core)


@torch.inference_mode()
def measure_max_rows(
    linears: list[QuantizedLinear], budget_s: float = 1.5, reps: int = 5
) -> tuple[int, list[tuple[int, float, float]]]:
    """The most rows at which the quantized kernels, over all the model's split linears, are
    still no slower than the dense ones: both timed at CANDIDATE_ROWS, interleaved, medians of
    `reps`, stopping at the first size the dense path wins or when `budget_s` is spent. Returns
    the rows and the timings (rows, quantized s, dense s)."""
    if not linears:
        return 0, []
    deadline = time.perf_counter() + budget_s
    best, timings = 0, []
    for rows in CANDIDATE_ROWS:
        quantized, dense = time_both(linears, rows, reps)
        timings.append((rows, quantized, dense))
        if quantized > dense:
            break
        best = rows
        if time.perf_counter() > deadline:
            break
    return best, timings


def time_both(linears: list[QuantizedLinear], rows: int, reps: int) -> tuple[float, float]:
    """Median seconds of one pass over all `linears` at `rows` rows: quantized, dense."""
    dtype = dense_dtype(linears[0].weight)
    kernels = cpu_kernels.load()
    if kernels is not None:  # the blocked kernels on as many threads as oneDNN, as in a step
        kernels.set_threads(torch.get_num_threads())
    xs = [torch.randn(rows, lin.weight.shape[1], dtype=dtype) for lin in linears]
    quantized, dense = [], []
    for _ in range(reps):
        start = time.perf_counter()
        for lin, x in zip(linears, xs, strict=True):
            lin.weight.matmul(x)
        middle = time.perf_counter()
        for lin, x in zip(linears, xs, strict=True):
            lin.dense(x)
        quantized.append(middle - start)
        dense.append(time.perf_counter() - middle)
    return statistics.median(quantized), statistics.median(dense)
