"""The GPU check (`make gpu-check`), under 8 minutes on one GPU:

1. logits of the served model against transformers on the device (fp32: prefill + decodes);
2. the Triton paged-attention kernels natively against the torch reference (their test file);
3. forward timings at decode batch 1/32/256 and prefill 2,048 against transformers on the same
   device (llmserve.bench.worker_forward);
4. the served stack's output tokens/s at 1, 32 and 256 concurrent streams.

It prints every figure; nothing is made up when a part cannot run (it says why). On a CPU,
`--device cpu --model tiny --quick` runs the same steps small (a test does, so the script
itself is checked here)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmserve import client  # noqa: E402
from llmserve.bench.hf_reference import hf_model  # noqa: E402
from llmserve.ports import free_ports, free_run  # noqa: E402
from llmserve.stack import Stack, StackSettings  # noqa: E402
from worker_svc.loader import load_model  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.work import WorkItem  # noqa: E402


def check_logits(model: str, device: str, decodes: int = 8) -> bool:
    """Prefill a prompt, then greedy decodes, in fp32 on both sides: max |difference| of the
    logits and whether every greedy token agrees."""
    torch.backends.cuda.matmul.allow_tf32 = False
    config, weights = load_model(model, torch.float32)
    theirs = hf_model(config, weights, torch.float32, attn="sdpa").to(device)
    blocks = 8
    ours = ModelRunner(config, weights, blocks * 4, 16, torch.float32, device=device)
    prompt = [1, 504, 3458, 282, 4649, 314, 2, 17, 29, 41][: min(10, config.vocab_size)]
    ids, worst, agree = list(prompt), 0.0, True
    item = WorkItem("check", list(prompt), 0, list(range(blocks)))
    with torch.inference_mode():
        for _ in range(decodes + 1):
            mine = ours.compute_logits([item])[0].float().cpu()
            ref = theirs(input_ids=torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
            worst = max(worst, (mine - ref).abs().max().item())
            token = int(mine.argmax())
            agree &= token == int(ref.argmax())
            item.start_position += len(item.token_ids)
            item.token_ids, item.sample_index = [token], item.sample_index + 1
            ids.append(token)
    ok = worst < 1e-2 and agree
    print(f"logits vs transformers ({model}, fp32, {device}): max |diff| {worst:.2e} over "
          f"{decodes + 1} steps; greedy tokens {'agree' if agree else 'DIFFER'}: "
          f"{'ok' if ok else 'FAILED'}")  # fmt: skip
    return ok


def check_kernels(device: str) -> bool:
    """The Triton kernels' tests, natively on the GPU (in the interpreter on the CPU)."""
    env = dict(os.environ, LLMSERVE_KERNEL_TEST_DEVICE=device)
    if not device.startswith("cuda"):
        env["TRITON_INTERPRET"] = "1"
    test = ROOT / "tests" / "test_triton_attention.py"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", str(test)], env=env, cwd=ROOT
    )
    print(f"Triton kernels vs torch on {device}: {'ok' if done.returncode == 0 else 'FAILED'}")
    return done.returncode == 0


def time_forward(model: str, device: str, quick: bool) -> None:
    batches, prefill, context = ("1,4", "64", "64") if quick else ("1,32,256", "2048", "512")
    subprocess.run(
        [sys.executable, "-m", "llmserve.bench.worker_forward", "--source", model,
         "--device", device,
         "--batches", batches, "--prefill", prefill, "--context", context,
         "--reps", "3" if quick else "10", "--theirs-attn", "sdpa"],
        cwd=ROOT, check=True,
    )  # fmt: skip


def serve_throughput(model: str, device: str, quick: bool) -> None:
    """Output tokens/s of the served stack at several concurrencies (closed loop: each stream
    sends its next request when the last one ends)."""
    levels, max_tokens, seconds = ((1, 4), 16, 5.0) if quick else ((1, 32, 256), 128, 30.0)
    ports = free_ports(2)
    settings = StackSettings(
        model=model, dtype="fp32" if quick else "bf16", device=device,
        gateway_port=ports[0], scheduler_port=ports[1], worker_base_port=free_run(1, ports),
        max_running=max(levels), kv_capacity=0 if device.startswith("cuda") else 16384,
        max_queued_requests=4 * max(levels),
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as logs, Stack(settings, Path(logs)):
        for level in levels:
            tokens = [0] * level
            stop = time.monotonic() + seconds

            def loop(i: int, tokens: list[int] = tokens, stop: float = stop) -> None:
                while time.monotonic() < stop:
                    request = client.make_request(
                        prompt=f"Story {i}: once upon a time", max_tokens=max_tokens,
                        temperature=0.0, ignore_eos=True,
                    )  # fmt: skip
                    for m in client.stream(settings.gateway, request, timeout=300):
                        tokens[i] += len(m.delta.token_ids)

            started = time.monotonic()
            threads = [threading.Thread(target=loop, args=(i,)) for i in range(level)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rate = sum(tokens) / (time.monotonic() - started)
            print(f"served {model} on {device}: {level:>3} concurrent -> {rate:,.0f} output tok/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU smoke run)")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: nothing measured (run it where there is a GPU)")
        return 2
    started = time.monotonic()
    ok = check_logits(args.model, args.device)
    ok &= check_kernels(args.device)
    time_forward(args.model, args.device, args.quick)
    serve_throughput(args.model, args.device, args.quick)
    print(f"gpu check {'passed' if ok else 'FAILED'} in {time.monotonic() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
