"""What verifying a draft costs on this worker: a decode step whose requests each carry a draft
of k tokens (1 + k rows of one request, its cached context shared) against the plain decode
step of the same requests (k = 0), side by side, for each int4 kernel asked.

    python -m llmserve.bench.draft_step --batches 1,8 --drafts 0,1,3,5 --kernels torch,blocked

Speculative decoding gains where a draft step costs little more than a plain one: with an
acceptance rate a and a draft of k, a step emits (1 - a^(k+1)) / (1 - a) tokens on average, so
the ratio printed ("x plain") is what those tokens must beat (docs/speculative.md). --kernels:
torch loads the model with torch's int4 and int8 kernels (LLMSERVE_BLOCKED_KERNELS=0), blocked
with this project's (worker_svc/blocked_matmul.py) where the CPU has AVX-512 BF16. All cases run
interleaved in one process; medians of --reps.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from llmserve.bench.forward_timing import Ours, median_ms  # noqa: E402
from llmserve.bench.quant_forward import cpu_line, int4_kernel, with_activations  # noqa: E402
from worker_svc.loader import load_model  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default="smollm2")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--drafts", default="0,1,3,5", help="draft lengths; 0 is the plain decode")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--quantization", default="auto")
    p.add_argument(
        "--kernels", default="torch,blocked",
        help="quantized kernels: torch, blocked, a8 (blocked int4 on int8 activations)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    drafts = sorted({0, *(int(d) for d in args.drafts.split(","))})
    kernels = args.kernels.split(",")
    runs, modes = [], []
    for kernel in kernels:
        mode = {"torch": f"{args.quantization}@torch", "a8": f"{args.quantization}@a8"}.get(
            kernel, args.quantization
        )
        modes.append(mode)
        with int4_kernel(mode) as plain:
            config, weights = load_model(args.source, torch.bfloat16, plain)
            runs.append(Ours(config, weights, torch.bfloat16, max(batches), args.context))
    print(
        f"{config.name}  quantization {args.quantization}  threads {torch.get_num_threads()}  "
        f"context {args.context}  reps {args.reps}\n{cpu_line()}"
    )
    cases = [(o, b, k) for b in batches for k in drafts for o in range(len(runs))]
    fns = [
        with_activations(modes[o], runs[o].draft(b, k) if k else runs[o].decode(b))
        for o, b, k in cases
    ]
    times = dict(zip(cases, median_ms(fns, args.reps), strict=True))
    head = "".join(f"{kernel + ' ms':>14}{'x plain':>9}" for kernel in kernels)
    ratio = f"{kernels[0]}/{kernels[-1]}" if len(kernels) > 1 else ""
    print(f"{'batch':>5} {'draft':>5} {'rows':>5}{head}{ratio:>14}")
    for b in batches:
        for k in drafts:
            cells = "".join(
                f"{times[o, b, k]:>14.1f}{times[o, b, k] / times[o, b, 0]:>8.2f}x"
                for o in range(len(runs))
            )
            speedup = f"{times[0, b, k] / times[len(runs) - 1, b, k]:>13.2f}x" if ratio else ""
            print(f"{b:>5} {k:>5} {b * (1 + k):>5}{cells}{speedup}")


if __name__ == "__main__":
    main()
