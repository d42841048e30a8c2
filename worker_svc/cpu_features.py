"""What the CPU can do, read from /proc/cpuinfo's flags, and the matrix paths that follow from it.

The tiers, best first: amx (AMX bf16 and int8 tiles: oneDNN's bf16 matmuls run on them),
avx512_bf16 (native bf16 dot products), avx512_vnni (int8 dot products, bf16 converted),
avx512, avx2, baseline (none of these: bf16 is emulated, slowly). Pure logic: no torch here
(torch's own view of the CPU, `torch.backends.cpu.get_cpu_capability()`, is asked by the
worker, worker_svc.kernel_plan).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
TIERS = ("amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2", "baseline")

# Rows (tokens of one matmul) up to which a 4-bit layer under --quantization auto runs the int4
# kernel (0.625 bytes read per weight: wins while the step is bound by memory bandwidth); above,
# its bf16 values (oneDNN, compute-bound). None: the int4 kernel at every size (no bf16 dot
# products: oneDNN's bf16 loses at every size), no bf16 copy kept. The row figures per tier are
# measured (docs/figures.md); avx512 is avx512_vnni's case (VNNI is int8 only) and baseline
# avx2's.
QUANTIZED_MAX_ROWS: dict[str, int | None] = {
    "amx": 8,
    "avx512_bf16": 8,
    "avx512_vnni": None,
    "avx512": None,
    "avx2": None,
    "baseline": None,
}

# The same for this project's own int4 kernel (worker_svc/blocked_matmul.py, on AVX-512 BF16),
# whose time grows far less with the rows than torch's. On avx512_bf16 (an AMD EPYC, SmolLM2's
# decode steps, 1 and 2 threads) it is 1.07x-1.5x faster than auto's old split (torch's int4 to
# 8 rows, oneDNN's bf16 above) from 6 to 32 rows, and 0.95-1.05x at 64: 32 keeps every size at
# least as fast as before (docs/figures.md). On amx the 8 is torch's kernel's figure, not
# measured for this one (no AMX host has measured it yet): oneDNN's AMX tiles are far faster at
# many rows. Tiers without AVX-512 BF16 never run it.
BLOCKED_INT4_MAX_ROWS: dict[str, int] = {"amx": 8, "avx512_bf16": 32}

# With this project's AMX int4 kernel (worker_svc/amx_matmul.c; amx tier, where it is built and
# the process may use the tiles): the blocked AVX-512 kernel below AMX_INT4_FROM_ROWS rows (each
# row computed alone: a draft's rows equal a plain decode's up to 8 rows, as before on amx),
# AMX tiles from there up to AMX_INT4_MAX_ROWS, oneDNN's bf16 on the dense copy above. On the
# Intel Xeon (SmolLM2's 30 layers' matrices, weights not in cache: llmserve.bench.layer_matmuls)
# the tiles against oneDNN's bf16 were, on 2 threads, 2.1-2.3x at 1-32 rows, 1.7x at 64, 1.6x
# at 128, 1.1x at 256 and 1.0-1.2x at 512-1024; on 1 thread 2.2x at 9 rows, 1.7x at 64, 1.3x at
# 128, 0.97x at 256, 0.88x at 512. 256 keeps every size at least level on 2 threads and within
# 3% on one; the dense copy serves the long prompt chunks above (docs/figures.md, "The AMX int4
# kernel's rows").
AMX_INT4_FROM_ROWS = 9

# With --int4-activations int8 (vnni_matmul.c), the blocked int4 kernel's rows on each tier
# (None: every size, no dense copy kept). On avx512_bf16 (the AMD EPYC, SmolLM2's 30 layers'
# matrices, llmserve.bench.layer_matmuls) it beat oneDNN's bf16 at every size measured, 1 to
# 1,024 rows: 1.3-1.6x on one thread, 1.2-1.5x on two (docs/benchmarks.md, "int4 on int8
# activations"). On amx the AMX tiles take over from AMX_INT4_FROM_ROWS as before.
A8_INT4_MAX_ROWS: dict[str, int | None] = {"avx512_bf16": None}
AMX_INT4_MAX_ROWS = 256

# Logit rows up to which the output matrix (vocab x hidden: SmolLM2's is 49,152 x 576, 57 MB in
# bf16, 46% of what a one-row decode step under auto reads) runs as int8 where the weights carry
# it so (Weights.lm_head_int8): a step samples one row per decode and one per prompt that ends,
# so nearly every step is in range. The int8 kernel's time grows with the rows, oneDNN's bf16
# does not: at a few rows the product is bound by reading the weights, on every tier
# (docs/figures.md).
OUTPUT_INT8_MAX_ROWS = 4
# The same for this project's own int8 kernel (blocked_matmul.py): on avx512_bf16 it beats
# oneDNN's bf16 up to 6 rows on one thread (ties at 6) and to 8 on two; 6 keeps a one-stream
# step with a draft of 5 on it. On amx (the Intel Xeon, 2 threads, SmolLM2's steps at 200
# positions: `llmserve.bench.step_profile` with the table patched): level at one row (the int8
# matrix reads 28 MB less, and the layers' weights stay in cache: 7.4 against 7.4 ms), but
# oneDNN's bf16 ahead from 2 rows (8.5 against 9.3 ms at 2, 10.9 against 12.9 at 4; the matrix
# alone, hot: 1.3 ms bf16 from 1 to 8 rows, int8 2.0 at 1, 2.7 at 4): hence 1. Greedy picks
# the same token either way: the logits near each row's maximum are recomputed from the bf16
# matrix (near_ties.py).
BLOCKED_OUTPUT_INT8_MAX_ROWS: dict[str, int] = {"amx": 1, "avx512_bf16": 6}

# The tiers on which `llmserve up`, where its workers take every core, runs a worker's steps of a
# few rows on one thread fewer (--small-step-threads -1). None: with the model loaded and its
# steps run on one thread (worker_svc/service.py `forward_thread`), two threads beat one at one
# stream on both tiers measured, avx512_bf16 and amx (docs/figures.md). The mechanism stays for
# a tier that gains from it; --small-step-threads sets it by hand.
SMALL_STEPS_LEAVE_A_CORE: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    flags: frozenset[str]  # the ones of FLAGS this CPU has
    model: str  # "model name" ("" where not said)
    threads_per_core: int  # SMT siblings per physical core (1 without SMT)

    @property
    def tier(self) -> str:
        has = self.flags.__contains__
        if has("amx_bf16") and has("amx_tile"):
            return "amx"
        if has("avx512_bf16"):
            return "avx512_bf16"
        if has("avx512_vnni"):
            return "avx512_vnni"
        if has("avx512f"):
            return "avx512"
        return "avx2" if has("avx2") else "baseline"

    @property
    def bf16_native(self) -> bool:
        """bf16 dot products in hardware (AVX-512 BF16 or AMX); elsewhere bf16 is converted."""
        return self.tier in ("amx", "avx512_bf16")

    @property
    def quantized_max_rows(self) -> int | None:
        return QUANTIZED_MAX_ROWS[self.tier]

    def int4_max_rows(self, blocked: bool, amx: bool = False, a8: bool = False) -> int | None:
        """quantized_max_rows for torch's int4 kernel, or for this project's (blocked; with its
        AMX kernel where `amx`: it runs on amx only; on int8 activations where `a8`)."""
        if blocked and amx and self.tier == "amx":
            return AMX_INT4_MAX_ROWS
        if blocked and a8 and self.tier in A8_INT4_MAX_ROWS:
            return A8_INT4_MAX_ROWS[self.tier]
        if blocked and self.tier in BLOCKED_INT4_MAX_ROWS:
            return BLOCKED_INT4_MAX_ROWS[self.tier]
        return self.quantized_max_rows

    def output_int8_max_rows(self, blocked: bool) -> int:
        """OUTPUT_INT8_MAX_ROWS for torch's int8 kernel, or for this project's (blocked)."""
        if blocked and self.tier in BLOCKED_OUTPUT_INT8_MAX_ROWS:
            return BLOCKED_OUTPUT_INT8_MAX_ROWS[self.tier]
        return OUTPUT_INT8_MAX_ROWS

    @property
    def small_steps_leave_a_core(self) -> bool:
        return self.tier in SMALL_STEPS_LEAVE_A_CORE

    def flag_text(self) -> str:
        return " ".join(f for f in FLAGS if f in self.flags) or "none"


def parse_cpuinfo(text: str) -> CpuFeatures:
    """The first processor's block of /proc/cpuinfo (x86 "flags"; other CPUs say "Features",
    where none of FLAGS appear)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: all cores are alike
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    words = set((fields.get("flags") or fields.get("features") or "").split())
    siblings, cores = _count(fields.get("siblings")), _count(fields.get("cpu cores"))
    smt = siblings // cores if siblings and cores and siblings >= cores else 1
    return CpuFeatures(frozenset(f for f in FLAGS if f in words), fields.get("model name", ""), smt)


def _count(value: str | None) -> int:
    return int(value) if value and value.isdigit() else 0


@cache
def host_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFeatures:
    """This host's CPU; no flags where /proc/cpuinfo cannot be read (not Linux)."""
    try:
        return parse_cpuinfo(cpuinfo.read_text())
    except OSError:
        return CpuFeatures(frozenset(), "", 1)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's or taskset's limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def pick_threads(default: int, cpus: int, threads_per_core: int) -> int:
    """Matmul threads: one per physical core this process may use, never more than torch's
    default (which counts the machine's cores, not the container's share)."""
    return max(1, min(default, cpus // max(1, threads_per_core)))
