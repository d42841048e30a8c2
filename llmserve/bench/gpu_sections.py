"""The GPU check's parts (scripts/gpu_check.py), each returning its figures as a dict: logits
against transformers, the Triton kernels' own tests, forward timings against transformers with
CUDA graphs on and off, and the KV pool sized from memory. Models are random weights at real
architectures' sizes built on the device (llmserve.bench.gpu_models): nothing is downloaded."""

from __future__ import annotations

import gc
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

from llmserve.bench.forward_timing import Ours, Theirs, median_ms
from llmserve.bench.gpu_models import random_model
from llmserve.bench.hf_reference import hf_model
from worker_svc.memory_profile import bytes_per_position, pool_positions, profile_blocks
from worker_svc.runner import ModelRunner
from worker_svc.settings import WorkerSettings
from worker_svc.work import WorkItem

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment(device: str) -> dict:
    """The device's name and every version a figure depends on."""
    import google.protobuf
    import grpc
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    on_gpu = device.startswith("cuda")
    name = torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu"
    memory = torch.cuda.get_device_properties(device).total_memory if on_gpu else 0
    return {
        "device": device,
        "device_name": name,
        "device_memory_gib": round(memory / GIB, 1),
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "grpcio": grpc.__version__,
        "protobuf": google.protobuf.__version__,
        "interpreter": sys.executable,
        "cpus": os.cpu_count(),
    }


# ---------------------------------------------------------------------------- logits


@torch.inference_mode()
def check_logits(shape_name: str, device: str, decodes: int = 8) -> dict:
    """A prompt's prefill and `decodes` decodes, ours and transformers' on the same random
    weights, in fp32 and in bf16. Both follow the fp32 reference's greedy tokens (a bf16 path may
    pick another token and wander off). fp32 passes within 1e-3 of the logits' scale with every
    greedy token equal; bf16 passes when ours is no further from the fp32 reference than
    transformers' bf16 is (twice its distance at most) and their greedy tokens mostly agree. On a
    CUDA device ours also runs by CUDA graphs (the prefill and the decodes each as a captured
    step), held to the same bounds against our eager path."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompt = [1, 504, 3458, 282, 4649, 314, 2, 17, 29, 41]
    blocks = -(-(len(prompt) + decodes + 1) // 16) + 1
    paths = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        config, weights = random_model(shape_name, dtype, device)
        theirs = hf_model(config, weights, dtype, attn="sdpa").to(device)
        ours = ModelRunner(config, weights, blocks, 16, dtype, device=device)
        graphs = None
        if torch.device(device).type == "cuda":
            graphs = ModelRunner(
                config, weights, blocks, 16, dtype, device=device, cuda_graphs=True
            )
        paths[label] = (ours, theirs, graphs)
    ids = list(prompt)
    item = WorkItem("check", list(prompt), 0, list(range(blocks)))
    steps = {label: {"ours": [], "theirs": [], "graphs": []} for label in paths}
    for _ in range(decodes + 1):
        for label, (ours, theirs, graphs) in paths.items():
            steps[label]["ours"].append(ours.compute_logits([item])[0].float().cpu())
            if graphs is not None:
                steps[label]["graphs"].append(graphs.compute_logits([item])[0].float().cpu())
            tokens = torch.tensor([ids], device=device)
            steps[label]["theirs"].append(theirs(input_ids=tokens).logits[0, -1].float().cpu())
        token = int(steps["fp32"]["theirs"][-1].argmax())
        item.start_position += len(item.token_ids)
        item.token_ids, item.sample_index = [token], item.sample_index + 1
        ids.append(token)
    reference = torch.stack(steps["fp32"]["theirs"])
    scale = reference.abs().max().item()
    result = {"shape": shape_name, "steps": decodes + 1, "logit_scale": round(scale, 3)}
    for label in paths:
        ours, theirs = torch.stack(steps[label]["ours"]), torch.stack(steps[label]["theirs"])
        result[label] = {
            "max_abs_diff_vs_transformers": (ours - theirs).abs().max().item(),
            "ours_max_abs_diff_vs_fp32_reference": (ours - reference).abs().max().item(),
            "theirs_max_abs_diff_vs_fp32_reference": (theirs - reference).abs().max().item(),
            "greedy_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
        }
        if steps[label]["graphs"]:
            graphs = torch.stack(steps[label]["graphs"])
            result[label]["graphs_max_abs_diff_vs_eager"] = (graphs - ours).abs().max().item()
            result[label]["graphs_greedy_agreement_vs_eager"] = (
                (graphs.argmax(-1) == ours.argmax(-1)).float().mean().item()
            )
    fp32, bf16 = result["fp32"], result["bf16"]
    fp32["ok"] = fp32["max_abs_diff_vs_transformers"] <= 1e-3 * scale and (
        fp32["greedy_agreement"] == 1.0
    )
    bf16["ok"] = bf16["ours_max_abs_diff_vs_fp32_reference"] <= 2 * max(
        bf16["theirs_max_abs_diff_vs_fp32_reference"], 1e-3 * scale
    ) and (bf16["greedy_agreement"] >= 0.75)
    for label, bound in (
        ("fp32", 1e-3 * scale),
        ("bf16", bf16["ours_max_abs_diff_vs_fp32_reference"]),
    ):
        d = result[label]
        if "graphs_max_abs_diff_vs_eager" in d:  # graphs: no further from eager than that
            d["ok"] = d["ok"] and d["graphs_max_abs_diff_vs_eager"] <= max(bound, 1e-3 * scale)
    result["ok"] = fp32["ok"] and bf16["ok"]
    del paths
    free_device_memory()
    return result


# ---------------------------------------------------------------------------- kernels

SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|error|errors|deselected)")


def run_kernel_tests(device: str, quick: bool) -> dict:
    """tests/test_triton_attention.py natively on a GPU (in Triton's interpreter on a CPU; quick:
    the fp32 decode kernel's cases only)."""
    env = dict(os.environ, LLMSERVE_KERNEL_TEST_DEVICE=device)
    if not device.startswith("cuda"):
        env["TRITON_INTERPRET"] = "1"
    test = ROOT / "tests" / "test_triton_attention.py"
    selection = ["-m", "not slow", "-k", "decode_kernel and fp32 and group3"] if quick else []
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         str(test), *selection],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    lines = (done.stdout + done.stderr).strip().splitlines()
    counts = {kind: int(n) for n, kind in SUMMARY.findall(lines[-1] if lines else "")}
    return {
        "native": device.startswith("cuda"),
        "selection": " ".join(selection) or "all",
        "counts": counts,
        "summary": lines[-1] if lines else "",
        "ok": done.returncode == 0 and counts.get("passed", 0) > 0,
        "output_tail": "\n".join(lines[-25:]) if done.returncode else "",
    }


# ---------------------------------------------------------------------------- timings


DRAFTED = 5  # the verify rows' draft: vLLM's num_speculative_tokens in its n-gram examples


def time_forwards(shape_name: str, device: str, quick: bool) -> dict:
    """Median ms of decode steps (batch 1/32/256, `context` cached positions each) and a
    prefill, ours with CUDA graphs on and off and transformers' (sdpa), same weights, bf16; and
    ours verifying drafts (1 + DRAFTED tokens a request, at 1 and 8 requests), with their cost
    in plain decode steps of the same batch (speculation gains where a step keeps more)."""
    sizes = ([1, 4], 64, 64, 3) if quick else ([1, 32, 256], 2048, 512, 10)
    batches, prefill, context, reps = sizes
    dtype = torch.bfloat16
    on_gpu = device.startswith("cuda")
    config, weights = random_model(shape_name, dtype, device)
    plain = Ours(config, weights, dtype, max(batches), context, device=device)
    contenders = {"ours_graphs_off": plain}
    if on_gpu:
        contenders["ours_graphs_on"] = Ours(
            config, weights, dtype, max(batches), context, device=device, cuda_graphs=True
        )
    contenders["transformers_sdpa"] = Theirs(config, weights, dtype, context, "sdpa", device)
    prompt = torch.randint(
        0, config.vocab_size, (prefill,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    cases = {f"decode@{b}": (lambda c, b=b: c.decode(b)) for b in batches}
    cases[f"prefill {prefill}"] = lambda c: c.prefill(prompt)
    rows = {}
    for case, make in cases.items():
        times = median_ms([make(c) for c in contenders.values()], reps)
        row = {name: round(ms, 3) for name, ms in zip(contenders, times, strict=True)}
        row["speedup_vs_transformers"] = round(row["transformers_sdpa"] / row["ours_graphs_off"], 2)
        if on_gpu:
            best = min(row["ours_graphs_on"], row["ours_graphs_off"])
            row["speedup_vs_transformers"] = round(row["transformers_sdpa"] / best, 2)
        rows[case] = row
    ours = {name: c for name, c in contenders.items() if isinstance(c, Ours)}
    for b in batches[:1] + [8] * (not quick):  # a step verifying drafts (speculative decoding)
        fns = [f for c in ours.values() for f in (c.draft(b, DRAFTED), c.decode(b))]
        times = median_ms(fns, reps)  # each verify beside a plain decode step of its batch
        row = {name: round(ms, 3) for name, ms in zip(ours, times[::2], strict=True)}
        row["times_a_decode"] = round(min(times[::2]) / min(times[1::2]), 2)
        rows[f"verify@{b} 1+{DRAFTED}"] = row
    del contenders, weights
    free_device_memory()
    return {
        "shape": shape_name,
        "dtype": "bf16",
        "context": context,
        "reps": reps,
        "cuda_graphs": "on and off" if on_gpu else "skipped: CUDA graphs need a CUDA device",
        "ms": rows,
    }


# ---------------------------------------------------------------------------- KV sizing


def kv_sizing(shape_name: str, device: str) -> dict:
    """The worker's own rule (worker_svc/memory_profile.py) on this device: the pool a worker of
    this shape gets at the default --memory-fraction and token budget, in bf16."""
    settings = WorkerSettings()
    dtype = torch.bfloat16
    target = torch.device(device)
    free_device_memory()
    used_before = 0
    if target.type == "cuda":
        free, total = torch.cuda.mem_get_info(target)
        used_before = total - free
    config, weights = random_model(shape_name, dtype, device)
    tokens = min(settings.profile_tokens, config.max_context)
    blocks = profile_blocks(tokens, settings.block_size)
    runner = ModelRunner(config, weights, blocks, settings.block_size, dtype, device=target)
    positions = pool_positions(config, weights, dtype, target, settings, runner, used_before)
    per_position = bytes_per_position(config, dtype)
    del runner, weights
    free_device_memory()
    return {
        "shape": shape_name,
        "memory_fraction": settings.memory_fraction,
        "profile_tokens": tokens,
        "used_before_gib": round(used_before / GIB, 2),
        "bytes_per_position": per_position,
        "positions": positions,
        "pool_gib": round(positions * per_position / GIB, 2),
    }
