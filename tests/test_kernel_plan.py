"""The worker picks its kernels for the host at start and says so in Describe: the CPU's tier
and flags, the quantization run, where auto's matmuls switch from the int4 kernel to the bf16
values, and the threads."""

from __future__ import annotations

import pytest

from worker_svc.__main__ import make_runner
from worker_svc.cpu_features import host_features
from worker_svc.kernel_plan import DENSE_PATHS as DENSE
from worker_svc.kernel_plan import dual_linears
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
    rows = asked or cpu.quantized_max_rows
    split = dual_linears(runner.model.linears)
    assert len(split) == 4 * runner.config.num_layers  # every layer matrix: Q4_1 in the file
    assert {lin.max_rows for lin in split} == {rows}
    assert info.quantization == "auto" and info.quantized_max_rows == rows
    assert info.cpu == cpu.tier and info.cpu_flags == cpu.flag_text()
    assert f"quantization auto: int4 kernel up to {rows} rows" in info.kernels
    assert info.threads >= 1


def test_describe_reports_a_plain_worker_unsplit():
    _, info = describe(model="tiny", quantization="auto")  # random values: nothing 4-bit to keep
    assert info.quantization == "auto" and info.quantized_max_rows == 0
    assert info.kernels.endswith("quantization auto: bf16 " + DENSE[info.cpu])
    assert info.cpu == host_features().tier


def test_a_simulated_worker_reports_no_kernels():
    _, info = describe(model="sim")
    assert info.cpu == "" and info.kernels == "" and info.quantized_max_rows == 0
