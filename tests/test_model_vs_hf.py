"""Our forward over the paged pool against transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.model_support import (
    PROMPTS,
    hf,
    hf_logits,
    model,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    prompt_ids,
    scattered_table,
)
from worker_svc.runner import ModelRunner
from worker_svc.work import WorkItem

ATOL = 1e-3


def check_prefill_and_decode(source: str, ids: list[int], split: int, block_size: int) -> None:
    """Prefill ids[:split] in two chunks, then feed ids[split:] one token at a time, over a
    shuffled block table; every position's logits must match HF's full forward."""
    config, weights = model(source)
    expected = hf_logits(hf(source), ids)  # [len(ids), vocab]
    runner = ModelRunner(config, weights, num_blocks=64, block_size=block_size, dtype=torch.float32)
    table = scattered_table(len(ids), block_size, 64, seed=len(ids))
    assert table != sorted(table)
    half = split // 2
    got = [
        runner.compute_logits([WorkItem("a", ids[:half], 0, table)], all_positions=True),
        runner.compute_logits([WorkItem("a", ids[half:split], half, table)], all_positions=True),
    ]
    for p in range(split, len(ids)):
        got.append(runner.compute_logits([WorkItem("a", [ids[p]], p, table)]))
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_tiny_prefill_and_scattered_decode_match_hf() -> None:
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    check_prefill_and_decode("tiny", ids, split=23, block_size=4)


@pytest.mark.slow
def test_smollm2_prefill_and_scattered_decode_match_hf() -> None:
    ids = prompt_ids(PROMPTS[2] + " there lived an old clockmaker who had a secret.")
    check_prefill_and_decode("smollm2", ids, split=9, block_size=4)


@pytest.mark.slow
def test_smollm2_greedy_generation_matches_hf_generate() -> None:
    """32 greedy tokens for several prompts, all generated together in shared steps."""
    config, weights = model("smollm2")
    reference = hf("smollm2")
    block_size = 16
    runner = ModelRunner(config, weights, num_blocks=64, block_size=block_size, dtype=torch.float32)
    prompts = [prompt_ids(text) for text in PROMPTS]
    tables = [list(range(60 - 4 * i, 60 - 4 * (i + 1), -1)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    items = [WorkItem(str(i), p, 0, tables[i]) for i, p in enumerate(prompts)]
    for step in range(32):
        tokens = runner.execute(items)
        for seq, token in zip(seqs, tokens, strict=True):
            seq.append(token)
        items = [
            WorkItem(str(i), [seq[-1]], len(seq) - 1, tables[i], sample_index=step + 1)
            for i, seq in enumerate(seqs)
        ]
    for prompt, seq in zip(prompts, seqs, strict=True):
        with torch.inference_mode():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
        generated = seq[len(prompt) :]
        if config.eos_token_ids[0] in generated:  # HF stops at EOS; we kept going
            generated = generated[: generated.index(config.eos_token_ids[0]) + 1]
        assert prompt + generated == out[0].tolist()
