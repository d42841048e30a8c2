"""Where a worker step's time goes: the layer matmuls, the output matrix, attention, the fused
norm and RoPE kernels, sampling (with the near-tie recompute), and the rest (Python between
kernels, the embedding, the attention plan), at each row count.

    python -m llmserve.bench.step_profile --rows 1,8,64 --context 256 --quantization auto
    python -m llmserve.bench.step_profile --rows 64 --prefill 128   (a 128-token prompt too)

Each part is timed where the real step calls it (the step is the worker's own `execute`, its
callees wrapped by timers for the run), so the parts add up to the step, less the rest. Medians
over --reps steps; the step's own median is timed without the timers, beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from llmserve.bench.forward_timing import Ours  # noqa: E402
from worker_svc import cpu_kernels, linear, model, near_ties, runner, sampling  # noqa: E402
from worker_svc.cpu_features import host_features  # noqa: E402
from worker_svc.loader import load_model  # noqa: E402

PARTS = (
    "layer matmuls",
    "output matrix",
    "near-tie recompute",
    "attention",
    "norms, rope, silu",
    "sampling",
    "rest",
)
OUTPUT_ROWS = 32768  # a matrix with this many output rows or more is the vocabulary's


class Timers:
    """Seconds per part in the current step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.depth = 0  # a part inside another (the dense form of a quantized linear) counts once

    def wrap(self, fn: Callable, part: str | Callable[..., str]) -> Callable:
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                name = part(*args) if callable(part) else part
                self.seconds[name] += time.perf_counter() - start
                self.depth -= 1

        return timed


def _matmul_part(layer, x, *rest) -> str:
    """The output matrix (vocabulary rows) or a layer's."""
    weight = layer.weight
    out = weight.shape[0] if weight is not None else 0
    return "output matrix" if out >= OUTPUT_ROWS else "layer matmuls"


@contextmanager
def timed(timers: Timers) -> Iterator[None]:
    """The step's callees wrapped by `timers` (on the classes and modules they are found in)."""
    patches = [
        (linear.Linear, "__call__", _matmul_part),
        (linear.QuantizedLinear, "__call__", _matmul_part),
        (model.LlamaModel, "attention", "attention"),
        (model.LlamaModel, "decode_attention", "attention"),
        (cpu_kernels.CpuKernels, "decode_attention", "attention"),
        (cpu_kernels.CpuKernels, "add_rms_norm", "norms, rope, silu"),
        (cpu_kernels.CpuKernels, "rope_store", "norms, rope, silu"),
        (cpu_kernels.CpuKernels, "silu_mul", "norms, rope, silu"),
        (cpu_kernels.CpuKernels, "refine_near_max", "near-tie recompute"),
        (near_ties, "refine_near_max", "near-tie recompute"),
        (model, "refine_near_max", "near-tie recompute"),
        (runner, "sample_tokens", "sampling"),
        (sampling, "sample_tokens", "sampling"),
    ]
    saved = []
    for owner, name, part in patches:
        fn = getattr(owner, name, None)
        if fn is None:
            continue
        saved.append((owner, name, fn))
        setattr(owner, name, timers.wrap(fn, part))
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def profile(step: Callable[[], object], reps: int) -> tuple[float, dict[str, float]]:
    """(the step's median ms untimed, median ms per part timed)."""
    for _ in range(2):
        step()
    plain, parts = [], defaultdict(list)
    timers = Timers()
    for _ in range(reps):
        start = time.perf_counter()
        step()
        plain.append(time.perf_counter() - start)
        timers.seconds.clear()
        with timed(timers):
            start = time.perf_counter()
            step()
            total = time.perf_counter() - start
        for part in PARTS[:-1]:
            parts[part].append(timers.seconds.get(part, 0.0))
        parts["rest"].append(total - sum(timers.seconds.values()))
        parts["step"].append(total)
    ms = {part: statistics.median(v) * 1e3 for part, v in parts.items()}
    return statistics.median(plain) * 1e3, ms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default="smollm2")
    p.add_argument("--rows", default="1,8,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--quantization", default="auto", help="none, int8, int4, auto")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--prefill", type=int, default=0, help="a prompt of this many tokens too")
    p.add_argument(
        "--kv-cache-dtype", default="auto", help="the KV pool's values, comma-separated: auto, int8"
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    config, weights = load_model(args.source, torch.bfloat16, args.quantization)
    print(
        f"{config.name} bf16, quantization {args.quantization}, threads "
        f"{torch.get_num_threads()}, context {args.context}, reps {args.reps}; cpu flags: "
        f"{' '.join(sorted(host_features().flags))}"
    )
    print(f"{'rows':>10} {'step ms':>8} {'timed':>8}  " + " ".join(f"{p:>18}" for p in PARTS))
    for cache_dtype in args.kv_cache_dtype.split(","):
        ours = Ours(
            config, weights, torch.bfloat16, max(rows), args.context, cache_dtype=cache_dtype
        )
        steps = [(str(n), ours.decode(n)) for n in rows]
        if args.prefill:
            prompt = torch.randint(
                0, config.vocab_size, (args.prefill,), generator=torch.Generator().manual_seed(0)
            ).tolist()
            steps.append((f"p{args.prefill}", ours.prefill(prompt)))
        for name, step in steps:
            plain, ms = profile(step, args.reps)
            cells = " ".join(f"{ms[p]:>11.1f} ({ms[p] / ms['step']:>4.0%})" for p in PARTS)
            label = name if cache_dtype == "auto" else f"{name} {cache_dtype}"
            print(f"{label:>10} {plain:>8.1f} {ms['step']:>8.1f} {cells}")
        del ours


if __name__ == "__main__":
    main()
