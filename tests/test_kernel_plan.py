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


def test_a_measured_threshold_is_the_last_size_the_quantized_path_still_wins(monkeypatch):
    """The rule, with the timings given (not timed here): sizes are tried in order and the
    first where the dense form is faster ends the search."""
    from worker_svc import kernel_plan

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
