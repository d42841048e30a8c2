"""Which attention backend runs: chosen by the tensors' device, overridable, never a silent
fall back when Triton is asked for; and the worker runs where triton is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from worker_svc.attention_backend import attention_backend, requested_backend, triton_importable

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
needs_triton = pytest.mark.skipif(not triton_importable(), reason="triton is not installed")


def test_cpu_tensors_take_the_torch_path_by_default() -> None:
    assert attention_backend(CPU) == "torch"


@needs_triton
def test_cuda_tensors_take_triton_by_default() -> None:
    assert attention_backend(CUDA) == "triton"


def test_torch_can_be_forced_on_cuda() -> None:
    assert attention_backend(CUDA, "torch") == "torch"


def test_forcing_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        attention_backend(CPU, "triton")


@needs_triton
def test_triton_can_be_forced_on_cpu_in_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention_backend(CPU, "triton") == "triton"


def test_the_environment_names_the_backend(monkeypatch) -> None:
    monkeypatch.delenv("LLMSERVE_ATTENTION", raising=False)
    assert requested_backend() == "auto"
    monkeypatch.setenv("LLMSERVE_ATTENTION", "triton")
    assert requested_backend() == "triton"
    monkeypatch.setenv("LLMSERVE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="auto, torch, triton"):
        requested_backend()


WITHOUT_TRITON = textwrap.dedent(
    """
    import json
    import sys
    sys.modules["triton"] = None  # as if not installed: importing it raises ImportError
    import torch
    from worker_svc.attention_backend import attention_backend
    from worker_svc.loader import tiny_model
    from worker_svc.runner import ModelRunner
    from worker_svc.work import WorkItem

    config, weights = tiny_model(torch.float32)
    runner = ModelRunner(config, weights, num_blocks=8, block_size=4, dtype=torch.float32)
    print(json.dumps(runner.execute([WorkItem("a", [5, 6], 0, [3]), WorkItem("b", [9], 0, [1])])))
    print(attention_backend(torch.device("cuda", 0)))
    """
)


def test_the_worker_runs_where_triton_is_not_installed() -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("LLMSERVE_ATTENTION", "TRITON_INTERPRET")
    }
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parents[1],
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    tokens, backend_on_cuda = done.stdout.splitlines()
    assert all(isinstance(token, int) for token in json.loads(tokens))
    assert backend_on_cuda == "torch"
