"""The worker runs every torch computation on one thread, its forward thread: the model's
loading (and the kernel plan's measurements, the memory profile) as well as its steps. A second
thread entering parallel regions gets an OpenMP team of its own, which slowed the first one's
two-thread steps about 2x (docs/benchmarks.md, "One thread for the model")."""

from __future__ import annotations

import asyncio
import threading

import pytest

from worker_svc import __main__ as worker_main
from worker_svc.service import WorkerService, forward_thread
from worker_svc.settings import WorkerSettings


def test_the_model_is_loaded_on_the_thread_that_runs_its_steps(monkeypatch) -> None:
    seen: list[str] = []

    def make_runner(settings):
        seen.append(threading.current_thread().name)
        raise ValueError("stop here")

    monkeypatch.setattr(worker_main, "make_runner", make_runner)
    with pytest.raises(SystemExit, match="stop here"):
        asyncio.run(worker_main.serve(WorkerSettings(model="sim", port=0)))
    assert len(seen) == 1 and seen[0].startswith("forward")
    assert seen[0] != threading.main_thread().name


def test_the_service_runs_its_steps_on_the_thread_it_is_given() -> None:
    forward = forward_thread()
    runner = worker_main.make_runner(WorkerSettings(model="sim"))
    service = WorkerService(WorkerSettings(model="sim"), runner, "sim", forward)
    assert service.executor is forward
    names = {forward.submit(lambda: threading.current_thread().name).result() for _ in range(3)}
    assert len(names) == 1
    forward.shutdown()
