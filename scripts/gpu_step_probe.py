"""Where a worker step's time goes on a GPU (a diagnostic beside scripts/gpu_check.py, whose
served part showed 256 streams slower than 32): the runner's execute at the served shapes,
CUDA graphs on and off, decode-only and mixed (decodes beside fresh 16-token prompts), each
timed end to end (host work + device + the one sync), and torch.profiler's top operators.

python3 scripts/gpu_step_probe.py --device cuda --out DIR   (--device cpu --quick: a rehearsal)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmserve.bench.gpu_carry import CARRY, bootstrap  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    bootstrap(CARRY)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from llmserve.bench.forward_timing import Ours, median_ms
    from llmserve.bench.gpu_models import random_model

    args.out.mkdir(parents=True, exist_ok=True)
    shape = "tiny" if args.quick else "smollm2-135m"
    dtype = torch.float32 if args.quick else torch.bfloat16
    batches = [1, 8] if args.quick else [1, 32, 128, 219, 256]
    context = 80  # the served part's: 16-token prompts, up to 128 tokens out
    config, weights = random_model(shape, dtype, args.device)
    cuda = args.device.startswith("cuda")
    rows = max(batches) + 4
    on = Ours(config, weights, dtype, rows, context, device=args.device, cuda_graphs=cuda)
    off = Ours(config, weights, dtype, rows, context, device=args.device)
    prompt = list(range(300, 316))
    figures: dict[str, dict[str, float]] = {}
    for b in batches:
        fns = {"graphs_on": on.decode(b), "graphs_off": off.decode(b)}
        if b > 1:
            fns["mixed_graphs_on"] = on.mixed(b - 1, prompt)
            fns["mixed_graphs_off"] = off.mixed(b - 1, prompt)
        ms = median_ms(list(fns.values()), reps=20, warmup=3)
        figures[f"decode@{b}"] = dict(zip(fns, [round(m, 3) for m in ms], strict=True))
        print(f"decode@{b}", figures[f"decode@{b}"], flush=True)
    big = max(batches)
    # the mixed graph against eager on the same KV: on's pool takes off's contents first
    from worker_svc.work import WorkItem

    slots = off.runner.pool.k.shape[1]
    on.runner.pool.k[:, :slots].copy_(off.runner.pool.k)
    on.runner.pool.v[:, :slots].copy_(off.runner.pool.v)
    drafts = [
        WorkItem(str(i), [100 + i, *range(200, 205)], context - 5, off.tables[i], sample_index=1,
                 drafted=5)
        for i in range(8)
    ]  # fmt: skip
    for name, items in {
        "mixed_graph_vs_eager": [
            *off.decode_items(big - 1),
            WorkItem("p", prompt, 0, off.tables[big - 1]),
        ],
        "draft_graph_vs_eager": drafts,
    }.items():
        eager = off.runner.compute_logits(items).float()
        graph = on.runner.compute_logits(items).float()
        figures[name] = {
            "items": len(items),
            "rows": graph.shape[0],
            "max_abs_diff": round((graph - eager).abs().max().item(), 4),
            "logit_scale": round(eager.abs().max().item(), 2),
            "greedy_agreement": (graph.argmax(-1) == eager.argmax(-1)).float().mean().item(),
        }
        print(name, figures[name], flush=True)
    graphs = on.runner.graphs
    figures["graph_shapes"] = [str(s) for s in graphs.graphs] if graphs else []  # type: ignore
    tables = {}
    for name, fn in {
        f"graphs_on decode@{big}": on.decode(big),
        f"graphs_off decode@{big}": off.decode(big),
        f"mixed {big - 1}+16 graphs_off": off.mixed(big - 1, prompt),
        f"mixed {big - 1}+16 graphs_on": on.mixed(big - 1, prompt),
        "graphs_on decode@1": on.decode(1),
    }.items():
        for _ in range(3):
            fn()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(5):
                fn()
        by_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        key = "self_cuda_time_total" if cuda else "cpu_time_total"
        by_dev = prof.key_averages().table(sort_by=key, row_limit=15)
        import cProfile
        import io
        import pstats

        py = cProfile.Profile()
        py.enable()
        for _ in range(5):
            fn()
        py.disable()
        text = io.StringIO()
        pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(20)
        by_py = text.getvalue()[-6000:]
        tables[name] = by_cpu + "\n" + by_dev + "\n" + by_py
        print(f"===== {name} (5 steps)\n{by_cpu}\n{by_dev}\n{by_py}", flush=True)
    (args.out / "probe.json").write_text(json.dumps(figures, indent=1))
    (args.out / "probe.txt").write_text("\n\n".join(f"===== {k}\n{v}" for k, v in tables.items()))


if __name__ == "__main__":
    main()
