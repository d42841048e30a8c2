"""SmolLM2's 30 layers of matrices (qkv, o, gate_up, down) at a row count, by each path that can
run them, side by side: oneDNN's bf16 on the dense copy (packed, as --quantization auto keeps
it), this project's blocked int4 kernel (AVX-512 BF16), the same on int8 activations ("a8", by
VNNI, where the CPU has it), and its AMX int4 kernel (where the CPU and the build have AMX).
30 distinct layers of seeded random 4-bit codes, so that the weights come from memory, not
cache, as in a step. Medians of --reps passes, the paths interleaved;
the ratio is oneDNN's time over the AMX kernel's.

python -m llmserve.bench.layer_matmuls --rows 1,8,9,16,32,64,128,256,512 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from llmserve.bench.quant_forward import cpu_line
from worker_svc import blocked_matmul, cpu_kernels
from worker_svc.linear import PACK_ROWS
from worker_svc.quant import int4_codes, kernel_values

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def layers() -> list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]]:
    """Per layer and matrix: (the int4 layout, oneDNN's packed bf16 values, outputs)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(LAYERS):
        mats = {}
        for name, (rows, cols) in SHAPES.items():
            codes = int4_codes(torch.randn(rows, cols, generator=gen) * 0.05)
            layout = blocked_matmul.int4_layout(codes.codes, codes.scale, codes.zero)
            dense = kernel_values(codes, torch.bfloat16)
            mats[name] = (layout, torch.ops.mkldnn._reorder_linear_weight(dense, PACK_ROWS), rows)
        out.append(mats)
    return out


def passes(kernels, mats, rows: int) -> dict[str, Callable[[], None]]:
    xs = {n: torch.randn(rows, cols, dtype=torch.bfloat16) for n, (_, cols) in SHAPES.items()}

    def run(how: str) -> Callable[[], None]:
        def one_pass() -> None:
            for layer in mats:
                for name, (layout, packed, out) in layer.items():
                    if how == "amx":
                        kernels.int4_matmul_amx(xs[name], layout, out)
                    elif how == "blocked":
                        kernels.blocked_matmul("int4", xs[name], layout, out)
                    elif how == "a8":
                        kernels.blocked_matmul("int4a8", xs[name], layout, out)
                    else:
                        torch.ops.mkldnn._linear_pointwise(xs[name], packed, None, "none", [], "")

        return one_pass

    hows = ["onednn"]
    if kernels is not None and kernels.blocked:
        hows.append("blocked")
    if kernels is not None and kernels.vnni:
        hows.append("a8")
    if kernels is not None and kernels.amx:
        hows.append("amx")
    return {how: run(how) for how in hows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,9,16,32,64,128,256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load()
    if kernels is not None:
        kernels.set_threads(args.threads)
    mats = layers()
    print(f"{LAYERS} layers of SmolLM2's matrices, threads {args.threads}, reps {args.reps}")
    print(cpu_line())
    header = None
    for rows in (int(r) for r in args.rows.split(",")):
        runs = passes(kernels, mats, rows)
        times: dict[str, list[float]] = {how: [] for how in runs}
        for fn in runs.values():
            fn()  # warm-up
        for _ in range(args.reps):
            for how, fn in runs.items():
                start = time.perf_counter()
                fn()
                times[how].append(time.perf_counter() - start)
        ms = {how: statistics.median(t) * 1e3 for how, t in times.items()}
        if header is None:
            header = f"{'rows':>5}" + "".join(f"{how + ' ms':>12}" for how in ms)
            print(
                header
                + ("   blocked/a8" if "a8" in ms else "")
                + ("   onednn/amx" if "amx" in ms else "")
            )
        line = f"{rows:>5}" + "".join(f"{v:>12.1f}" for v in ms.values())
        if "a8" in ms:
            line += f"   {ms['blocked'] / ms['a8']:>9.2f}x"
        if "amx" in ms:
            line += f"   {ms['onednn'] / ms['amx']:>10.2f}x"
        print(line)


if __name__ == "__main__":
    main()
