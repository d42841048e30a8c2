"""Decode attention alone over a bf16 pool and an int8 pool (--kv-cache-dtype), side by side.

    python -m llmserve.bench.attention_kv [--threads 2] [--shapes 1x200,8x200,64x200,64x1000]

Each shape is requests x cached positions, SmolLM2's heads (9 query, 3 KV, head_dim 64), blocks
of 16 handed out shuffled. One layer's pool is attended 30 times (a step's layers), so a pool
that fits the cache stays there: these figures show the kernels' arithmetic, and where one
layer's pool outgrows the L3 (64 x 1,000: 49 MB in bf16), their reads too; the worker's step
(llmserve.bench.step_profile --kv-cache-dtype auto,int8) has a pool per layer. Medians of 30
calls, the best of two alternating rounds, in ms for the 30.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from worker_svc import cpu_kernels
from worker_svc.cpu_features import host_features
from worker_svc.kv_pool import quantize_kv

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def timed(call, reps: int = 30) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3 * LAYERS


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default="1x200,8x200,64x200,64x1000,1x4000")
    args = p.parse_args(argv)
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("no C kernels here (no compiler, or LLMSERVE_CPU_KERNELS=0)")
    kernels.set_threads(args.threads)
    print(f"threads {args.threads}; cpu flags: {' '.join(sorted(host_features().flags))}")
    print(f"{'requests x positions':>22}{'bf16 ms':>10}{'int8 ms':>10}{'bf16 / int8':>13}")
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        n, context = (int(v) for v in shape.split("x"))
        a, b = compare(kernels, n, context, gen)
        print(f"{shape:>22}{a:>10.2f}{b:>10.2f}{a / b:>12.2f}x")


def compare(kernels, n: int, context: int, gen: torch.Generator) -> tuple[float, float]:
    """(bf16 ms, int8 ms) for n requests of `context` cached positions."""
    per = -(-context // BLOCK)
    blocks = n * per + 4
    k = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen).to(torch.bfloat16)
    v = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen).to(torch.bfloat16)
    (kc, ks), (vc, vs) = quantize_kv(k), quantize_kv(v)
    q = torch.randn(n, HEADS, DIM, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    tables = torch.randperm(blocks, generator=gen)[: n * per].view(n, per).contiguous()
    common = (tables, torch.full((n,), context), BLOCK, KV_HEADS, DIM**-0.5, out)
    scales = (ks.data_ptr(), vs.data_ptr())

    def bf16() -> None:
        kernels.decode_attention(q, k.data_ptr(), v.data_ptr(), *common)

    def int8() -> None:
        kernels.decode_attention(q, kc.data_ptr(), vc.data_ptr(), *common, scales=scales)

    rounds = [(timed(bf16), timed(int8)) for _ in range(2)]
    return min(r[0] for r in rounds), min(r[1] for r in rounds)


if __name__ == "__main__":
    main()
