"""Steps of a few rows on fewer threads (the worker's --small-step-threads, which `llmserve up`
sets where the workers take every core and the gateway and scheduler share them): the runner
switches torch's thread count by the step's rows, and the answer is the same either way."""

from __future__ import annotations

import pytest
import torch

from llmserve.stack import StackSettings
from tests.model_support import model
from worker_svc.cpu_features import parse_cpuinfo
from worker_svc.runner import ModelRunner
from worker_svc.settings import WorkerSettings
from worker_svc.work import WorkItem

BF16 = torch.bfloat16


def seen_threads(runner: ModelRunner, rows: int) -> int:
    """The thread count a step of `rows` decodes ran with (read inside its forward)."""
    seen = []
    forward = runner.compute_logits

    def spy(items, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return forward(items, *args, **kwargs)

    runner.compute_logits = spy
    items = [WorkItem(str(i), [5 + i], 0, [i]) for i in range(rows)]
    runner.execute(items)
    runner.compute_logits = forward
    return seen[0]


def test_small_steps_run_on_their_threads_and_larger_ones_on_all() -> None:
    before = torch.get_num_threads()
    try:
        config, weights = model("tiny", BF16)
        runner = ModelRunner(config, weights, num_blocks=16, block_size=4, dtype=BF16)
        runner.thread_steps(2, small_rows=4, small_threads=1)
        assert [seen_threads(runner, rows) for rows in (1, 4, 5, 8, 2)] == [1, 1, 2, 2, 1]
        runner.thread_steps(2)  # no small steps: every step on all threads
        assert [seen_threads(runner, rows) for rows in (1, 8)] == [2, 2]
    finally:
        torch.set_num_threads(before)


def test_a_step_gives_the_same_tokens_on_one_thread_as_on_two() -> None:
    before = torch.get_num_threads()
    try:
        config, weights = model("tiny", BF16)
        tokens = []
        for small_threads in (1, 2):
            runner = ModelRunner(config, weights, num_blocks=16, block_size=4, dtype=BF16)
            runner.thread_steps(2, small_rows=4, small_threads=small_threads)
            prompt = WorkItem("a", [3, 9, 27, 81], 0, [0, 1])
            runner.execute([prompt])
            tokens.append(runner.execute([WorkItem("a", [11], 4, [0, 1])]))
        assert tokens[0] == tokens[1]
    finally:
        torch.set_num_threads(before)


def worker_flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


ZEN4 = "avx2 avx512f avx512_vnni avx512_bf16"  # the tier once measured to gain (cpu_features)
SAPPHIRE = ZEN4 + " amx_tile amx_bf16 amx_int8"  # the tier measured to lose


def on_cpu(monkeypatch, flags: str) -> None:
    from llmserve import stack

    cpu = parse_cpuinfo(f"processor\t: 0\nflags\t\t: {flags}\n")
    monkeypatch.setattr(stack, "host_features", lambda: cpu)


def test_llmserve_up_leaves_a_core_to_the_control_plane_only_where_the_workers_take_them_all(
    monkeypatch, tmp_path
) -> None:
    from llmserve import stack
    from worker_svc import cpu_features

    monkeypatch.setattr(cpu_features, "SMALL_STEPS_LEAVE_A_CORE", frozenset({"avx512_bf16"}))
    on_cpu(monkeypatch, ZEN4)
    monkeypatch.setattr(stack.os, "cpu_count", lambda: 2)
    every_core = stack.Stack(StackSettings(model="tiny", workers=1), tmp_path)
    command = every_core.worker_command(0, 1)
    assert (worker_flag(command, "--threads"), worker_flag(command, "--small-step-threads")) == (
        "2",
        "1",
    )
    spare = stack.Stack(StackSettings(model="tiny", workers=1, threads=1), tmp_path)
    assert worker_flag(spare.worker_command(0, 1), "--small-step-threads") == "0"
    asked = stack.Stack(StackSettings(model="tiny", workers=1, small_step_threads=0), tmp_path)
    assert worker_flag(asked.worker_command(0, 1), "--small-step-threads") == "0"
    monkeypatch.setattr(stack.os, "cpu_count", lambda: 16)
    roomy = stack.Stack(StackSettings(model="tiny", workers=1, threads=8), tmp_path)
    assert worker_flag(roomy.worker_command(0, 1), "--small-step-threads") == "0"


def test_only_a_cpu_measured_to_gain_runs_small_steps_on_fewer_threads(monkeypatch, tmp_path):
    """None is now: with the model on one thread (one OpenMP team) two threads won on the
    tier that had gained (docs/benchmarks.md, "One thread for the model")."""
    from llmserve import stack
    from worker_svc import cpu_features

    monkeypatch.setattr(stack.os, "cpu_count", lambda: 2)
    for measured, flags, small in (
        (frozenset(), ZEN4, "0"), (frozenset(), SAPPHIRE, "0"), (frozenset(), "avx2", "0"),
        (frozenset({"avx512_bf16"}), ZEN4, "1"), (frozenset({"avx512_bf16"}), SAPPHIRE, "0"),
    ):  # fmt: skip
        monkeypatch.setattr(cpu_features, "SMALL_STEPS_LEAVE_A_CORE", measured)
        on_cpu(monkeypatch, flags)
        every_core = stack.Stack(StackSettings(model="tiny", workers=1), tmp_path)
        assert worker_flag(every_core.worker_command(0, 1), "--small-step-threads") == small, flags


def test_the_worker_refuses_a_negative_small_step_setting() -> None:
    with pytest.raises(ValueError, match="small-step"):
        WorkerSettings(small_step_threads=-1)
