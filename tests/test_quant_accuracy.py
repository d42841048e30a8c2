"""The accuracy guard of --quantization on the shipped SmolLM2 GGUF (Q4_1 layers): each mode's
next-token distributions against the unquantized bf16 path over a fixed prompt set (top-1
agreement, mean KL), and the demo's greedy answers. Bounds: the figures measured on an AMX
host, every row through the quantized kernels (docs/models.md), with margin: auto (int4 layers,
int8 output) 0.976 and 0.0042 nats, int8 0.964 and 0.0072 nats."""

from __future__ import annotations

import pytest
import torch

from gateway.tokenizer import load_default_tokenizer
from llmserve.bench.quant_accuracy import (
    agreement,
    chat_ids,
    greedy,
    make_runner,
    next_token_logits,
    prompt_set,
)
from worker_svc.linear import QuantizedLinear
from worker_svc.quant import Int4Weight, Int8Weight

BOUNDS = {"auto": (0.95, 0.015), "int8": (0.92, 0.03)}  # (top-1 at least, mean KL at most)
MODES = ("none", "auto", "int8")


@pytest.fixture(scope="module")
def runners():
    return {mode: make_runner("smollm2", mode) for mode in MODES}


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_tokenizer()


def test_modes_run_the_kernels_they_name(runners):
    assert isinstance(runners["none"].model.weights.layers[0].qkv, torch.Tensor)
    assert isinstance(runners["auto"].model.weights.layers[0].qkv, Int4Weight)
    assert isinstance(runners["int8"].model.weights.layers[0].qkv, Int8Weight)
    # auto keeps the file's Q8_0 output matrix as int8; none and int8 run it in bf16
    head = runners["auto"].model.lm_head
    assert isinstance(head, QuantizedLinear) and isinstance(head.weight, Int8Weight)
    assert head.dense is None  # the guard scores every row through the kernel
    assert not isinstance(runners["none"].model.lm_head, QuantizedLinear)
    assert not isinstance(runners["int8"].model.lm_head, QuantizedLinear)


@pytest.mark.parametrize("mode", ["auto", "int8"])
def test_next_token_distribution_stays_near_bf16(runners, tokenizer, mode):
    prompts = prompt_set(tokenizer)
    reference = next_token_logits(runners["none"], prompts)
    measured = agreement(reference, next_token_logits(runners[mode], prompts))
    min_top1, max_kl = BOUNDS[mode]
    assert measured.positions > 300
    assert measured.top1 >= min_top1, measured
    assert measured.mean_kl <= max_kl, measured
    assert measured.mean_kl > 0  # the quantized path did run: not the bf16 one


@pytest.mark.parametrize("mode", MODES)
def test_demo_greedy_answers_keep_their_meaning(runners, tokenizer, mode):
    stop = (tokenizer.eos_token_id,)

    def answer(question: str) -> str:
        ids = greedy(runners[mode], chat_ids(tokenizer, question), 24, stop)
        return tokenizer.decode(ids, skip_special_tokens=True).lower()

    assert "paris" in answer("What is the capital of France?")
    colors = answer("Name three primary colors.")
    assert all(c in colors for c in ("red", "blue", "yellow")), colors
