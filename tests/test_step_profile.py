"""The step profiler times a worker's real step by parts, and leaves the worker as it found it."""

from __future__ import annotations

import torch

from llmserve.bench.forward_timing import Ours
from llmserve.bench.step_profile import PARTS, profile
from tests.model_support import one_torch_thread  # noqa: F401  (autouse fixture)
from worker_svc import cpu_kernels, linear
from worker_svc.loader import load_model


def test_the_parts_of_a_step_are_timed_where_it_calls_them_and_the_timers_go_after() -> None:
    before = (linear.Linear.__call__, linear.QuantizedLinear.__call__)
    kernels_before = getattr(cpu_kernels.CpuKernels, "decode_attention", None)
    config, weights = load_model("tiny", torch.bfloat16, "auto")
    ours = Ours(config, weights, torch.bfloat16, 4, context=40)
    plain, ms = profile(ours.decode(4), reps=2)
    assert plain > 0 and set(PARTS) <= set(ms)
    assert ms["layer matmuls"] > 0 and ms["output matrix"] > 0 and ms["attention"] > 0
    assert sum(ms[p] for p in PARTS[:-1]) <= ms["step"]
    plain, ms = profile(ours.prefill(list(range(1, 24))), reps=2)  # a prompt's step too
    assert plain > 0 and ms["layer matmuls"] > 0 and ms["attention"] > 0 and ms["sampling"] > 0
    assert sum(ms[p] for p in PARTS[:-1]) <= ms["step"]
    assert (linear.Linear.__call__, linear.QuantizedLinear.__call__) == before
    assert getattr(cpu_kernels.CpuKernels, "decode_attention", None) is kernels_before
