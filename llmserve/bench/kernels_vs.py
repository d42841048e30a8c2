"""Our worker's step against the same worker with an earlier revision's CPU kernels and oneDNN
packing, side by side in one process.

python -m llmserve.bench.kernels_vs --base-rev 271508e [--base-pack-rows 1]
    [--quantization none,auto] [--batches 1,16,64] [--context 200] [--reps 15] [--threads 2]

The base is this checkout with two things swapped: the fused decode kernels built from
`worker_svc/cpu_kernels.c` as it stood at --base-rev (`git show`, compiled with this checkout's
flags), and oneDNN's weight layout packed for --base-pack-rows rows (the earlier
`worker_svc/linear.py` packed for 1), the torch path for the decodes' attention in steps that
mix decodes with a prompt chunk (a padded gather, as before the fused kernel took those too),
and silu(gate) * up as two torch ops (as before silu_mul). Everything else is the same code, so
the ratios are those changes'. Per quantization mode both are loaded once and the cases run
interleaved (base, new, base, new ...): load from other processes hits both alike. Medians; the
ratio is base's time over new's (above 1: new is faster). A first table times decode attention
alone over 30 layers of KV pools (SmolLM2's shape, blocks shuffled), where the layers' KV is
read from memory, not from cache. The host's CPU flags are printed with the tables: compare
only within one run.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

import worker_svc.linear as linear
from llmserve.bench.forward_timing import Ours, median_ms
from llmserve.bench.quant_forward import cpu_line
from worker_svc import cpu_kernels
from worker_svc.loader import load_model
from worker_svc.model import torch_mlp

REPO = Path(__file__).resolve().parents[2]


def base_kernels(rev: str, workdir: Path) -> cpu_kernels.CpuKernels:
    """The fused kernels as they stood at `rev`, built here with this checkout's flags (with the
    files it includes as they stood then, where it had them)."""
    source = workdir / "cpu_kernels_base.c"
    source.write_text(git_show(rev, "worker_svc/cpu_kernels.c"))
    for included in cpu_kernels.INCLUDED:
        try:
            (workdir / included.name).write_text(git_show(rev, f"worker_svc/{included.name}"))
        except SystemExit:
            pass  # not there at rev: nor is the #include
    return built_kernels(source, workdir / "base.so", f"{rev}'s kernels")


def built_kernels(source: Path, library: Path, what: str) -> cpu_kernels.CpuKernels:
    """`source` compiled into `library` with this checkout's flags, loaded."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler: the fused kernels cannot be built")
    command = [compiler, *cpu_kernels.FLAGS, *cpu_kernels.ARCH_FLAGS[0], "-o", str(library),
               str(source), "-lm"]  # fmt: skip
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    if built.returncode:
        raise SystemExit(f"building {what} failed: {built.stderr[-800:]}")
    return cpu_kernels.CpuKernels(ctypes.CDLL(str(library)))


def git_show(rev: str, path: str) -> str:
    shown = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    if shown.returncode:
        raise SystemExit(f"git show {rev}: {shown.stderr.strip()}")
    return shown.stdout


LAYERS, BLOCK, HEADS, KV_HEADS, DIM = 30, 16, 9, 3, 64  # SmolLM2's attention, 30 layers


def attention_pass(nd: int, context: int) -> tuple[Callable[[object], None], int, torch.Tensor]:
    """One decode step's attention over 30 layers of KV pools, `nd` requests of `context`
    positions, blocks shuffled: a function of the kernels that runs it, the bytes it reads, and
    the tensor it writes."""
    per = -(-(context + 1) // BLOCK)
    blocks = nd * per + 8
    gen = torch.Generator().manual_seed(0)
    shape = (LAYERS, blocks, BLOCK, KV_HEADS, DIM)
    k = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v = torch.randn(shape, generator=gen).to(torch.bfloat16)
    order = torch.randperm(blocks, generator=gen).tolist()
    tables = torch.tensor([order[i * per : (i + 1) * per] for i in range(nd)])
    lengths = torch.full((nd,), context + 1)
    q = torch.randn(nd, HEADS, DIM, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    stride = k.stride(0) * k.element_size()

    def run(kernels) -> None:
        for layer in range(LAYERS):
            kernels.decode_attention(
                q, k.data_ptr() + layer * stride, v.data_ptr() + layer * stride, tables,
                lengths, BLOCK, KV_HEADS, DIM**-0.5, out,
            )  # fmt: skip

    return run, LAYERS * nd * (context + 1) * KV_HEADS * DIM * 2 * 2, out


def attention_table(base, new, context: int, reps: int, batches: list[int]) -> None:
    """Decode attention alone: 30 layers of pools, SmolLM2's heads (9 query, 3 KV, dim 64)."""
    print(f"decode attention, {LAYERS} layers, {context} positions per request")
    print(f"{'requests':<10}{'base ms':>9}{'new ms':>9}{'x new':>8}{'new GB/s':>10}")
    for nd in batches:
        run, read, _ = attention_pass(nd, context)
        b, n = median_ms([lambda: run(base), lambda: run(new)], reps)  # noqa: B023
        print(f"{nd:<10}{b:>9.1f}{n:>9.1f}{b / n:>7.2f}x{read / n / 1e6:>10.1f}")


def torch_path(model) -> None:
    """The base's torch parts: mixed steps' decodes' attention (a padded gather of every
    context), as before the fused kernel took them, and silu(gate) * up as two torch ops."""

    def attend(layer_index, q, plan, pool, out) -> None:
        out.copy_(model.decode_attention(layer_index, q, plan, pool))

    model.fused_decode_attention = attend
    model.mlp = torch_mlp


def model_table(mode: str, base, pack_rows: int, batches, context, prefill, reps) -> None:
    runs = []
    for rows, kernels in ((pack_rows, base), (linear.PACK_ROWS, None)):
        saved, linear.PACK_ROWS = linear.PACK_ROWS, rows
        try:
            config, weights = load_model("smollm2", torch.bfloat16, mode)
            ours = Ours(config, weights, torch.bfloat16, max(batches) + 1, context)
        finally:
            linear.PACK_ROWS = saved
        if kernels is not None:
            ours.runner.model.kernels = kernels
            torch_path(ours.runner.model)
        runs.append(ours)
    print(f"\n--quantization {mode}: base (packed for {pack_rows} rows, base kernels, mixed steps'"
          f" decodes on the torch path) / new (packed for {linear.PACK_ROWS}), {context} positions"
          " per request; 'B + P': B decodes beside a P-token prompt")  # fmt: skip
    print(f"{'case':<14}{'base ms':>9}{'new ms':>9}{'x new':>8}")
    prompt = list(range(100, 100 + prefill))
    cases = [(f"decode @{b}", lambda o, b=b: o.decode(b)) for b in batches]
    cases.append((f"prefill {prefill}", lambda o: o.prefill(prompt)))
    cases += [(f"{b} + {prefill}", lambda o, b=b: o.mixed(b, prompt)) for b in batches]
    for name, make in cases:
        b, n = median_ms([make(o) for o in runs], reps)
        print(f"{name:<14}{b:>9.1f}{n:>9.1f}{b / n:>7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-rev", required=True, help="git revision of the base kernels")
    parser.add_argument("--base-pack-rows", type=int, default=1)
    parser.add_argument("--quantization", default="none,auto")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--prefill", type=int, default=128)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    new = cpu_kernels.load()
    if new is None:
        raise SystemExit("the fused kernels are not available here (no C compiler?)")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"threads={torch.get_num_threads()}  reps={args.reps}  base={args.base_rev}")
    print(cpu_line())
    with tempfile.TemporaryDirectory() as workdir:
        base = base_kernels(args.base_rev, Path(workdir))
        for kernels in (base, new):
            kernels.set_threads(torch.get_num_threads())
        attention_table(base, new, args.context, args.reps, batches)
        for mode in args.quantization.split(","):
            model_table(mode, base, args.base_pack_rows, batches, args.context, args.prefill,
                        args.reps)  # fmt: skip


if __name__ == "__main__":
    main()
