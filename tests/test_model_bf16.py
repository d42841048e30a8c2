"""bf16 (the serving dtype): prepacked linears are exact, and we track transformers in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.model_support import (
    hf,
    hf_logits,
    model,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    prompt_ids,
    scattered_table,
)
from worker_svc.linear import Linear, packing_available
from worker_svc.runner import ModelRunner
from worker_svc.work import WorkItem


@pytest.mark.skipif(not packing_available(torch.bfloat16), reason="no oneDNN bf16 on this CPU")
def test_packed_linear_equals_f_linear() -> None:
    gen = torch.Generator().manual_seed(0)
    # SmolLM2's down projection: packed for one row, oneDNN sums in another order from 64 rows
    w = torch.randn(576, 1536, generator=gen).to(torch.bfloat16)
    lin = Linear(w, pack=True)
    assert lin.packed is not None
    for rows in (1, 5, 64, 128, 300):
        x = torch.randn(rows, 1536, generator=gen).to(torch.bfloat16)
        assert torch.equal(lin(x), F.linear(x, w))


def bf16_logits(source: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, HF's) all-position logits in bf16; ours prefill half, then decode the rest."""
    config, weights = model(source, torch.bfloat16)
    runner = ModelRunner(config, weights, num_blocks=32, block_size=4, dtype=torch.bfloat16)
    table = scattered_table(len(ids), 4, 32, seed=5)
    split = len(ids) // 2
    rows = [runner.compute_logits([WorkItem("a", ids[:split], 0, table)], all_positions=True)]
    for p in range(split, len(ids)):
        rows.append(runner.compute_logits([WorkItem("a", [ids[p]], p, table)]))
    return torch.cat(rows), hf_logits(hf(source, torch.bfloat16), ids)


def test_tiny_bf16_tracks_hf() -> None:
    ids = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    ours, theirs = bf16_logits("tiny", ids)
    assert (ours - theirs).abs().max() < 0.1 * theirs.abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


@pytest.mark.slow
def test_smollm2_bf16_tracks_hf() -> None:
    ids = prompt_ids("The history of the Roman Empire begins with the founding of Rome, and")
    ours, theirs = bf16_logits("smollm2", ids)
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() < 0.05 * scale
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9
