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
import inspect
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from worker_svc.loader import load_model  # noqa: E402
from worker_svc.model_config import ModelConfig  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.weights import Weights  # noqa: E402
from worker_svc.work import WorkItem  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def median_ms(fns: list[Callable[[], object]], reps: int, warmup: int = 2) -> list[float]:
    """Median wall time of each fn; runs are interleaved (A B A B ...) so that load from other
    processes on a shared machine hits all contenders alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, record in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            record.append(time.perf_counter() - start)
    return [statistics.median(record) * 1e3 for record in times]


class Ours:
    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        dtype: torch.dtype,
        max_batch: int,
        context: int,
        block_size: int = 16,
        device: str = "cpu",
        cuda_graphs: bool = False,
    ) -> None:
        """cuda_graphs: decode steps replay CUDA graphs (a CUDA device only, as in a worker)."""
        self.block_size = block_size
        per_request = -(-(context + 1) // block_size)
        num_blocks = max_batch * per_request + 8
        self.runner = ModelRunner(
            config, weights, num_blocks, block_size, dtype, device=device, cuda_graphs=cuda_graphs
        )
        # cached positions hold random values (timing does not depend on them); blocks are
        # handed out shuffled, as they would be after a while of serving
        self.runner.pool.k.normal_()
        self.runner.pool.v.normal_()
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables = [order[i * per_request : (i + 1) * per_request] for i in range(max_batch)]
        self.context = context

    def decode_items(self, batch: int) -> list[WorkItem]:
        return [
            WorkItem(str(i), [100 + i], self.context, self.tables[i], sample_index=1)
            for i in range(batch)
        ]

    def decode(self, batch: int) -> Callable[[], object]:
        items = self.decode_items(batch)
        return lambda: self.runner.execute(items)

    def prefill(self, ids: list[int]) -> Callable[[], object]:
        items = [WorkItem("p", ids, 0, self.tables[0])]
        return lambda: self.runner.execute(items)

    def mixed(self, batch: int, ids: list[int]) -> Callable[[], object]:
        """`batch` decodes beside a fresh prompt's whole chunk (max_batch must exceed batch)."""
        items = [*self.decode_items(batch), WorkItem("p", ids, 0, self.tables[batch])]
        return lambda: self.runner.execute(items)


class Theirs:
    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        dtype: torch.dtype,
        context: int,
        attn: str = "sdpa",
        device: str = "cpu",
    ) -> None:
        from llmserve.bench.hf_reference import hf_model

        self.config = config
        self.dtype = dtype
        self.attn = attn
        self.device = torch.device(device)
        self.model = hf_model(config, weights, dtype, attn=attn).to(self.device)
        self.context = context

    def decode(self, batch: int) -> Callable[[], object]:
        from transformers import DynamicCache

        cfg = self.config
        cache = DynamicCache(config=self.model.config)
        shape = (batch, cfg.num_kv_heads, self.context, cfg.head_dim)
        on = {"dtype": self.dtype, "device": self.device}
        for layer in range(cfg.num_layers):
            cache.update(torch.randn(shape, **on), torch.randn(shape, **on), layer)
        ids = torch.arange(100, 100 + batch, device=self.device).view(batch, 1)
        positions = torch.full((batch, 1), self.context, device=self.device)
        mask = torch.ones(batch, self.context + 1, dtype=torch.int64, device=self.device)

        # the cache's argument is `cache` in recent transformers, `past_key_values` before
        takes = inspect.signature(self.model.forward).parameters
        given = {"cache" if "cache" in takes else "past_key_values": cache}

        @torch.inference_mode()
        def step() -> object:
            out = self.model(
                input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, **given
            )
            cache.crop(-1)  # back to the same cached length
            return out.logits[:, -1].argmax(-1).tolist()  # waits for the device, as ours does

        return step

    def prefill(self, ids: list[int]) -> Callable[[], object]:
        tokens = torch.tensor([ids], device=self.device)

        @torch.inference_mode()
        def step() -> object:
            logits = self.model(input_ids=tokens, logits_to_keep=1).logits
            return logits[:, -1].argmax(-1).tolist()

        return step


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
        from llmserve.bench.quant_forward import quantization_table

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
        from llmserve.bench.quant_forward import bytes_per_decode_step

        read = bytes_per_decode_step(weights)
        print(
            f"decode @1 reads {read / 1e6:.0f} MB of weights per step: {read / single / 1e6:.1f} "
            f"GB/s effective; at 27 GB/s the step cannot beat {read / 27e9 * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
