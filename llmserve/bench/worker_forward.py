"""Ours vs transformers on the same weights and dtype: decode steps and a prompt prefill.

python -m llmserve.bench.worker_forward [--source smollm2] [--dtype bf16] [--reps 10] [--threads 2]
python -m llmserve.bench.worker_forward --quantization none,int4,auto  (ours per mode vs bf16)

transformers runs with each attention implementation named in --theirs-attn (sdpa and eager by
default); "theirs" is the faster of them in each case, so the baseline is the best transformers
offers here (on this CPU eager beats sdpa at decode: sdpa's CPU flash kernel is slow for one
query row).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from llmserve.bench.forward_timing import Ours, Theirs, median_ms  # noqa: E402
from llmserve.bench.quant_forward import bytes_per_decode_step, quantization_table  # noqa: E402
from worker_svc.loader import load_model  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--context", type=int, default=200, help="cached positions per request")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--prefill", type=int, default=128)
    parser.add_argument("--ours-only", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--theirs-attn", default="sdpa,eager", help="transformers attention impls")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument(
        "--quantization",
        default="",
        help="e.g. int8,int4,auto: our step times in each mode against bf16 (none), side by side "
        "(llmserve/bench/quant_forward.py); transformers is not run",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quantization:
        modes, batches = args.quantization.split(","), [int(b) for b in args.batches.split(",")]
        quantization_table(args.source, modes, batches, args.prefill, args.context, args.reps)
        return
    dtype = DTYPES[args.dtype]
    batches = [int(b) for b in args.batches.split(",")]
    config, weights = load_model(args.source, dtype)
    print(
        f"{config.name}  dtype={args.dtype}  threads={torch.get_num_threads()}  "
        f"context={args.context}  reps={args.reps}  device={args.device}"
    )
    ours = Ours(config, weights, dtype, max(batches), args.context, device=args.device)
    attns = [] if args.ours_only else args.theirs_attn.split(",")
    theirs = [Theirs(config, weights, dtype, args.context, a, args.device) for a in attns]
    prompt = torch.randint(
        0, config.vocab_size, (args.prefill,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    cases = [(f"decode @{b}", lambda s, b=b: s.decode(b)) for b in batches]
    cases.append((f"prefill {args.prefill}", lambda s: s.prefill(prompt)))
    print(f"{'case':<14}{'ours ms':>10}{'theirs ms':>11}  {'(attention)':<12}{'speed-up':>9}")
    single = None
    for name, make in cases:
        mine, *others = median_ms([make(ours)] + [make(t) for t in theirs], args.reps)
        if name == "decode @1":
            single = mine
        if not others:
            print(f"{name:<14}{mine:>10.1f}")
            continue
        best = min(range(len(others)), key=others.__getitem__)
        other = others[best]
        detail = "  ".join(f"{t.attn} {o:.1f}" for t, o in zip(theirs, others, strict=True))
        print(
            f"{name:<14}{mine:>10.1f}{other:>11.1f}  {theirs[best].attn:<12}"
            f"{other / mine:>8.2f}x   ({detail})"
        )
    if single is not None:
        read = bytes_per_decode_step(weights)
        print(
            f"decode @1 reads {read / 1e6:.0f} MB of weights per step: {read / single / 1e6:.1f} "
            f"GB/s effective; at 27 GB/s the step cannot beat {read / 27e9 * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
