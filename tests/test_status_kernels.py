"""`llmserve status` says what kernels each worker picked for its host at start (its Describe's
`kernels`, carried by the scheduler's Status)."""

from __future__ import annotations

import pytest

from llmcommon.v1 import scheduler_pb2
from llmserve import client
from llmserve.client import status_dict
from llmserve.status_text import format_status
from tests.stack_checks import wait_for
from tests.stacks import running_stack, tiny_settings
from worker_svc.cpu_features import host_features

PLAN = "cpu avx512_bf16 (avx2 avx512f; torch AVX512), 2 threads, quantization auto: int4 ..."


def test_status_text_prints_each_workers_kernels() -> None:
    reply = scheduler_pb2.StatusReply(policy="paged", mode="continuous")
    reply.workers.add(name="worker0", address="10.0.0.5:50061", healthy=True, kernels=PLAN)
    reply.workers.add(name="worker1", address="10.0.0.6:50061", healthy=True)  # simulated
    s = status_dict(reply)
    assert [w["kernels"] for w in s["workers"]] == [PLAN, ""]
    lines = format_status(s).splitlines()
    assert sum("kernels:" in line for line in lines) == 1
    first = next(i for i, line in enumerate(lines) if "worker0" in line)
    second = next(i for i, line in enumerate(lines) if "worker1" in line)
    assert any(f"kernels: {PLAN}" in line for line in lines[first:second])


@pytest.mark.slow
@pytest.mark.usefixtures("hang_guard")
def test_the_scheduler_reports_what_its_worker_picked(tmp_path) -> None:
    settings = tiny_settings(quantization="none")
    with running_stack(settings, tmp_path / "logs") as stack:

        def reported() -> list[str]:
            return [w.kernels for w in client.status(stack.settings.scheduler).workers]

        wait_for(lambda: reported() != [], 30, "the worker joined")
        (kernels,) = reported()
    cpu = host_features()
    assert kernels.startswith(f"cpu {cpu.tier} ({cpu.flag_text()}; torch ")
    assert "1 threads, quantization none: fp32 MKL" in kernels  # tiny_settings: fp32, 1 thread
