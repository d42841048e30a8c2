"""The worker picks its kernels for the host at start and says so in Describe: the CPU's tier
and flags, the quantization run, where auto's matmuls switch from the int4 kernel to the bf16
values, and the threads."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from worker_svc import blocked_matmul, kernel_plan
from worker_svc.__main__ import make_runner
from worker_svc.cpu_features import (
    AMX_INT4_FROM_ROWS,
    BLOCKED_INT4_MAX_ROWS,
    QUANTIZED_MAX_ROWS,
    host_features,
    parse_cpuinfo,
)
from worker_svc.kernel_plan import DENSE_PATHS as DENSE
from worker_svc.kernel_plan import dual_linears, plan_kernels, quantized_linears
from worker_svc.loader import load_model
from worker_svc.quant import fuse_matrices, int4_codes
from worker_svc.runner import ModelRunner
from worker_svc.service import WorkerService
from worker_svc.settings import WorkerSettings


def describe(**fields):
    settings = WorkerSettings(kv_capacity=256, **fields)
    runner = make_runner(settings)
    return runner, WorkerService(settings, runner, settings.model).describe()


@pytest.mark.parametrize("asked", [0, 3])
def test_describe_reports_where_auto_switches_paths(asked):
    runner, info = describe(model="smollm2", quantization="auto", quantized_max_rows=asked)
    cpu = host_features()
    quantized = quantized_linears(runner.model.linears)
    kernel = quantized[0].weight.kernel  # "blocked int4" where this project's kernel runs
    amx = quantized[0].weight.amx_from_rows  # 9 where the AMX tiles run (an amx-tier CPU)
    assert amx == (AMX_INT4_FROM_ROWS if blocked_matmul.amx_usable() else 0)
    # 0: this CPU's table says int4 at every size
    rows = asked or cpu.int4_max_rows(kernel == "blocked int4", amx > 0) or 0
    assert len(quantized) == 4 * runner.config.num_layers  # every layer matrix: Q4_1 in the file
    split = dual_linears(runner.model.linears)
    assert {lin.max_rows for lin in split} == ({rows} if rows else set())
    assert info.quantization == "auto" and info.quantized_max_rows == rows
    assert info.cpu == cpu.tier and info.cpu_flags == cpu.flag_text()
    if amx:
        kernel = f"{kernel} kernel up to {amx - 1} rows, AMX int4 tiles"
    else:
        kernel += " kernel"
    path = f"{kernel} up to {rows} rows" if rows else f"{kernel} at every size"
    assert f"quantization auto: {path}" in info.kernels
    head = runner.model.lm_head.weight  # Q8_0 in the file: int8
    head_rows = cpu.output_int8_max_rows(head.blocked is not None)
    assert info.kernels.endswith(f"; output {head.kernel} up to {head_rows} rows")
    assert info.threads >= 1


def test_describe_reports_a_plain_worker_unsplit():
    _, info = describe(model="tiny", quantization="auto")  # random values: nothing 4-bit to keep
    assert info.quantization == "auto" and info.quantized_max_rows == 0
    assert info.kernels.endswith("quantization auto: bf16 " + DENSE[info.cpu])
    assert info.cpu == host_features().tier


def test_a_simulated_worker_reports_no_kernels():
    _, info = describe(model="sim")
    assert info.cpu == "" and info.kernels == "" and info.quantized_max_rows == 0


def test_a_measured_threshold_is_the_last_size_the_quantized_path_still_wins(monkeypatch):
    """The rule, with the timings given (not timed here): sizes are tried in order and the
    first where the dense form is faster ends the search."""
    dense_wins_from = {1: 16, 2: 1, 3: 10**6}  # case -> the first rows at which dense is faster
    for case, first in dense_wins_from.items():
        tried = []

        def fake(linears, rows, reps, first=first, tried=tried):
            tried.append(rows)
            return (2.0, 1.0) if rows >= first else (1.0, 2.0)  # (quantized s, dense s)

        monkeypatch.setattr(kernel_plan, "time_both", fake)
        rows, timings = kernel_plan.measure_max_rows([object()], budget_s=60)
        wins = [r for r in kernel_plan.CANDIDATE_ROWS if r < first]
        assert rows == (wins[-1] if wins else 0), case
        assert tried == [r for r in kernel_plan.CANDIDATE_ROWS if r <= first], case
        assert [t[0] for t in timings] == tried


def tiny_auto_runner():
    """The tiny model with its layer matrices as 4-bit codes run as auto (both forms), off the
    AMX tiles (the plans below are for CPUs without them)."""
    config, plain = load_model("tiny", torch.bfloat16)

    def auto(m):
        weight = fuse_matrices([int4_codes(m.float())], "auto", torch.bfloat16)
        return replace(weight, amx_from_rows=0)

    layers = [
        replace(lw, qkv=auto(lw.qkv), o=auto(lw.o), gate_up=auto(lw.gate_up), down=auto(lw.down))
        for lw in plain.layers
    ]
    return ModelRunner(config, replace(plain, layers=layers), 8, 16, torch.bfloat16)


def cpu_of(tier_flags: str):
    return parse_cpuinfo(f"processor\t: 0\nflags\t\t: {tier_flags}\n\n")


AVX2_CPU, ZEN4_CPU = "fma avx avx2", "avx2 avx512f avx512_vnni avx512_bf16"


def test_without_bf16_dot_products_auto_runs_int4_at_every_size_and_keeps_no_copy():
    runner = tiny_auto_runner()
    plan = plan_kernels(runner, cpu_of(AVX2_CPU), "bf16", "auto")
    linears = quantized_linears(runner.model.linears)
    assert len(linears) == 4 * runner.config.num_layers
    assert all(lin.dense is None for lin in linears)  # the bf16 copies let go
    assert plan.quantized_max_rows == 0 and plan.fields()["quantized_max_rows"] == 0
    kernel = linears[0].weight.kernel
    assert plan.summary().endswith(f"quantization auto: {kernel} kernel at every size (cpu table)")


def test_asked_rows_split_even_where_the_table_would_not():
    runner = tiny_auto_runner()
    plan_kernels(runner, cpu_of(AVX2_CPU), "bf16", "auto")  # dropped the copies
    plan = plan_kernels(runner, cpu_of(AVX2_CPU), "bf16", "auto", asked_rows=3)
    linears = quantized_linears(runner.model.linears)
    assert all(lin.dense is not None and lin.max_rows == 3 for lin in linears)
    kernel = linears[0].weight.kernel
    assert f"{kernel} kernel up to 3 rows (--quantized-max-rows), bf16 oneDNN AVX2 above" in (
        plan.summary()
    )
    split = plan_kernels(runner, cpu_of(ZEN4_CPU), "bf16", "auto")
    table = BLOCKED_INT4_MAX_ROWS if kernel == "blocked int4" else QUANTIZED_MAX_ROWS
    rows = table["avx512_bf16"]
    assert split.quantized_max_rows == rows and {lin.max_rows for lin in linears} == {rows}
