"""Shared helpers for the worker model tests: cached model loads, the HF oracle, KV layouts."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from worker_svc.loader import load_model  # noqa: E402
from worker_svc.model_config import ModelConfig  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.weights import Weights  # noqa: E402
from worker_svc.work import WorkItem  # noqa: E402


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Model tests run single-threaded: on a small CPU shared with other jobs, two OpenMP
    threads stall at every parallel region whenever the other core is busy (10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Photosynthesis converts",
]


@functools.cache
def model(source: str, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, Weights]:
    return load_model(source, dtype)


@functools.cache
def hf(source: str, dtype: torch.dtype = torch.float32):
    from llmserve.bench.hf_reference import hf_model

    config, weights = model(source, dtype)
    return hf_model(config, weights, dtype)


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    from llmcommon.model_files import default_gguf_path

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def prompt_ids(text: str) -> list[int]:
    return list(tokenizer()(text).input_ids)


@functools.cache
def hf_from_gguf():
    """LlamaForCausalLM filled by transformers' own GGUF reader (its dequantize and q/k
    un-permute), independent of ours: the benchmark's baseline model, in fp32."""
    from llmserve.bench.hf_baseline import load_hf_model

    return load_hf_model("fp32", attention="sdpa")


@functools.cache
def hf_dir_from_gguf() -> Path:
    """An HF model directory (config.json + safetensors) that transformers made from the GGUF."""
    out = Path(tempfile.mkdtemp(prefix="llmserve-hf-smollm2-"))
    atexit.register(shutil.rmtree, out, True)
    hf_from_gguf().save_pretrained(out)
    return out


def scattered_table(num_positions: int, block_size: int, num_blocks: int, seed: int) -> list[int]:
    """Distinct block ids in a shuffled order, enough for num_positions."""
    need = -(-num_positions // block_size)
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=gen)[:need].tolist()


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """All-position logits [len(ids), vocab] fp32 from the HF model."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def run_alone(
    runner: ModelRunner, ids: list[int], table: list[int], chunk: int, steps: int
) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill ids in chunks, then greedy-decode steps tokens; returns (logits per sampled step,
    generated tokens)."""
    logits, out = [], []
    pos = 0
    while pos < len(ids):
        part = ids[pos : pos + chunk]
        last = pos + len(part) == len(ids)
        item = WorkItem("r", part, pos, table, sample=last)
        if last:
            row = runner.compute_logits([item])[0]
            logits.append(row)
            out.append(int(row.argmax()))
        else:
            runner.compute_logits([item])
        pos += len(part)
    for _ in range(steps - 1):
        item = WorkItem("r", [out[-1]], len(ids) + len(out) - 1, table)
        row = runner.compute_logits([item])[0]
        logits.append(row)
        out.append(int(row.argmax()))
    return logits, out
