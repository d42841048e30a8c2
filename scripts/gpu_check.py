"""The GPU check (`make gpu-check`; docs/gpu.md), one command under 8 minutes on one GPU, with the
machine's own python3 and packages: no venv, no pip, nothing downloaded. It carries what such a
machine lacks in build/gpu-carry (`make gpu-carry`: the gRPC stubs, two pure-Python packages)
and builds its models on the device from configs (random weights at real architectures' sizes).

1. logits of ours against transformers on the same random weights (SmolLM2-135M's shape), fp32
   and bf16;
2. the Triton paged-attention kernels' own tests, natively;
3. forward timings, decode at batch 1/32/256 and a prefill of 2,048, against transformers on
   the same device, CUDA graphs on and off (SmolLM2-135M's and Llama-3.2-1B's shapes);
4. the KV pool sized from the device's memory (those shapes and Llama-3.1-8B's);
5. the served stack's output tokens/s at 1, 32 and 256 concurrent, and the worker's busy
   fraction at the real step time.

It prints every figure with the device's name and the versions, and writes gpu-check.json and
gpu-check.md into --out (after each part: a run cut short keeps what it measured). A part that
cannot run says why; nothing is made up. `--device cpu --quick` runs the same parts small on a
CPU (tests/test_gpu_check_portable.py does, in an environment shaped like the GPU machine's)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmserve.bench.gpu_carry import CARRY, bootstrap  # noqa: E402  (standard library only)
from llmserve.bench.gpu_report import SECTIONS as PARTS  # noqa: E402  (standard library only)

FULL = {
    "logits": ["smollm2-135m"],
    "forward_timings": ["smollm2-135m", "llama-3.2-1b"],
    "kv_sizing": ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"],
    "served": ["smollm2-135m"],
}
QUICK = {part: ["tiny"] for part in FULL}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a rehearsal)")
    parser.add_argument("--quick", action="store_true", help="small shapes and sizes (CPU)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gpu-check")
    parser.add_argument("--carry", type=Path, default=CARRY, help="the carried folder")
    parser.add_argument(
        "--budget-s", type=float, default=450.0, help="no part starts after this many seconds"
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="the parts to run, comma-separated (a rerun takes only those that failed)",
    )
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}: choose from {', '.join(PARTS)}")
    return args


class Check:
    """Runs the parts in order, records each as ok / failed / skipped, writes after each."""

    def __init__(self, args: argparse.Namespace, report: dict) -> None:
        self.args, self.report = args, report
        self.started = time.monotonic()

    def part(self, name: str, shapes: list[str], measure: Callable[[str], dict]) -> None:
        from llmserve.bench.gpu_report import section, write

        if name not in self.args.parts:
            self.report["sections"][name] = section("skipped", "not asked for (--parts)")
            return
        results, failures = [], []
        for shape in shapes:
            if time.monotonic() - self.started > self.args.budget_s:
                failures.append(f"{shape}: skipped, past the {self.args.budget_s:.0f} s budget")
                continue
            print(f"== {name} ({shape})", flush=True)
            try:
                result = measure(shape)
            except Exception as error:  # noqa: BLE001  (one part's failure is reported, not fatal)
                traceback.print_exc()
                failures.append(f"{shape}: {type(error).__name__}: {str(error)[-600:]}")
                continue
            print(json.dumps(result, indent=1), flush=True)
            results.append(result)
            if result.get("ok") is False:
                failures.append(f"{shape}: a check failed")
        status = "failed" if failures else "ok"
        if failures and not results and all("budget" in f for f in failures):
            status = "skipped"
        self.report["sections"][name] = section(status, "; ".join(failures), results)
        self.totals()
        write(self.report, self.args.out)

    def totals(self) -> None:
        sections = [s for name, s in self.report["sections"].items() if name in self.args.parts]
        self.report["passed"] = bool(sections) and all(s["status"] == "ok" for s in sections)
        self.report["total_s"] = round(time.monotonic() - self.started, 1)

    def finish(self) -> int:
        from llmserve.bench.gpu_report import markdown, write

        self.totals()
        data, text = write(self.report, self.args.out)
        print(markdown(self.report))
        print(f"wrote {data} and {text}")
        return 0 if self.report["passed"] else 1


def no_device(args: argparse.Namespace, report: dict) -> int:
    """On a machine without the device asked for: every part skipped, saying why."""
    from llmserve.bench.gpu_report import SECTIONS, section, write

    reason = f"{args.device}: no CUDA device here (run it where there is a GPU)"
    report["sections"] = {name: section("skipped", reason) for name in SECTIONS}
    report["passed"] = False
    write(report, args.out)
    print(reason)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stubs = bootstrap(args.carry)
    import torch

    report: dict = {
        "command": " ".join(
            ["python3 scripts/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "stubs": stubs,
        "carry": str(args.carry),
        "quick": args.quick,
        "sections": {},
    }
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        return no_device(args, report)
    from llmserve.bench import gpu_sections as parts
    from llmserve.bench.gpu_served import run_child

    report["environment"] = parts.environment(args.device)
    print(json.dumps(report["environment"], indent=1), flush=True)
    plan, check = QUICK if args.quick else FULL, Check(args, report)
    check.part("logits", plan["logits"], lambda s: parts.check_logits(s, args.device))
    check.part(
        "kernels",
        ["test_triton_attention"],
        lambda _: parts.run_kernel_tests(args.device, args.quick),
    )
    check.part(
        "forward_timings",
        plan["forward_timings"],
        lambda s: parts.time_forwards(s, args.device, args.quick),
    )
    check.part("kv_sizing", plan["kv_sizing"], lambda s: parts.kv_sizing(s, args.device))
    levels, window, tokens = ([1, 4], 2.0, 16) if args.quick else ([1, 32, 256], 8.0, 128)
    check.part(
        "served",
        plan["served"],
        lambda s: run_child(
            s, args.device, levels, window, tokens, "bf16" if on_gpu else "fp32",
            0 if on_gpu else 16384, timeout=300,
        ),
    )  # fmt: skip
    return check.finish()


if __name__ == "__main__":
    raise SystemExit(main())
