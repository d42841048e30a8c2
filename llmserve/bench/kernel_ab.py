"""The fused decode kernels from two C sources side by side in one process: decode attention over
30 layers of KV pools (as llmserve.bench.kernels_vs's first table), and the norm and RoPE
kernels at a 64-row step's shapes, run interleaved (base, new, base, new ...), medians.

python -m llmserve.bench.kernel_ab --base /tmp/old_cpu_kernels.c [--new worker_svc/cpu_kernels.c]
    [--batches 1,2,4,8,64] [--context 200] [--reps 15] [--threads 2]

Each source is built with this checkout's flags, without the files it includes (the AMX matmul
kernels: not timed here).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from llmserve.bench.forward_timing import median_ms
from llmserve.bench.kernels_vs import attention_pass, built_kernels
from worker_svc import cpu_kernels

REPO = Path(__file__).resolve().parents[2]


def built(source: Path, workdir: Path, name: str) -> cpu_kernels.CpuKernels:
    """`source`, less its #include of another .c file, built with this checkout's flags."""
    text = "\n".join(
        line for line in source.read_text().splitlines() if not line.startswith('#include "')
    )
    copy = workdir / f"{name}.c"
    copy.write_text(text + "\n")
    return built_kernels(copy, workdir / f"{name}.so", str(source))


def small_kernels(rows: int, layers: int = 30):
    """A step's norms (two per layer) and RoPE stores at SmolLM2's shapes, `rows` tokens."""
    hidden, heads, kv_heads, dim = 576, 9, 3, 64
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    delta = (0.1 * torch.randn(rows, hidden, generator=gen)).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
    h = torch.empty_like(x)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(torch.bfloat16)
    angles = torch.arange(512).float()[:, None] * 0.01 * torch.arange(dim).float()
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    positions = torch.full((rows,), 200)
    slots = torch.randperm(4 * rows, generator=gen)[:rows]
    q = torch.empty(rows, heads, dim, dtype=torch.bfloat16)
    k_pool = torch.zeros(4 * rows, kv_heads, dim, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)

    def run(kernels) -> None:
        for _ in range(layers):
            kernels.add_rms_norm(x, delta, weight, 1e-5, h)
            kernels.rope_store(qkv, cos, sin, positions, slots, q, k_pool.data_ptr(),
                               v_pool.data_ptr(), kv_heads)  # fmt: skip
            kernels.add_rms_norm(x, delta, weight, 1e-5, h)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the base C source")
    parser.add_argument("--new", default=str(REPO / "worker_svc" / "cpu_kernels.c"))
    parser.add_argument("--batches", default="1,2,4,8,64")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base = built(Path(args.base), Path(tmp), "base")
        new = built(Path(args.new), Path(tmp), "new")
        for kernels in (base, new):
            kernels.set_threads(args.threads)
        print(f"decode attention, 30 layers, {args.context} positions, threads {args.threads}")
        print(f"{'requests':<10}{'base ms':>9}{'new ms':>9}{'x new':>8}{'new GB/s':>10}")
        for nd in [int(b) for b in args.batches.split(",")]:
            run, read, _ = attention_pass(nd, args.context)
            b, n = median_ms([lambda: run(base), lambda: run(new)], args.reps)  # noqa: B023
            print(f"{nd:<10}{b:>9.2f}{n:>9.2f}{b / n:>7.2f}x{read / n / 1e6:>10.1f}")
        print("norms and rope, 30 layers")
        for rows in (1, 64):
            run = small_kernels(rows)
            b, n = median_ms([lambda: run(base), lambda: run(new)], args.reps)  # noqa: B023
            print(f"{rows:<10}{b:>9.2f}{n:>9.2f}{b / n:>7.2f}x")


if __name__ == "__main__":
    main()
