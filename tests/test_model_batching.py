"""One step mixing prefills (some chunked) and decodes == each request run alone."""

from __future__ import annotations

import pytest
import torch

from tests.model_support import (
    model,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    prompt_ids,
    run_alone,
)
from worker_svc.runner import ModelRunner
from worker_svc.work import WorkItem


def run_mixed(source: str, prompts: list[list[int]], chunk: int, steps: int, block_size: int):
    """All requests in shared steps: request i joins at step i, so prefill chunks of some
    requests run in the same execute() as decodes of others."""
    config, weights = model(source)
    runner = ModelRunner(config, weights, num_blocks=96, block_size=block_size, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    free = torch.randperm(96, generator=gen).tolist()
    need = [-(-(len(p) + steps) // block_size) for p in prompts]
    tables = [[free.pop() for _ in range(n)] for n in need]
    done = [0] * len(prompts)  # prompt tokens processed
    outs: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    mixed_steps = 0
    for step in range(len(prompts) + 64):
        items, owners = [], []
        for i, prompt in enumerate(prompts):
            if step < i or len(outs[i]) >= steps:
                continue
            if done[i] < len(prompt):
                part = prompt[done[i] : done[i] + chunk]
                last = done[i] + len(part) == len(prompt)
                items.append(WorkItem(str(i), part, done[i], tables[i], sample=last))
                done[i] += len(part)
            else:
                pos = len(prompt) + len(outs[i]) - 1
                items.append(WorkItem(str(i), [outs[i][-1]], pos, tables[i]))
            owners.append(i)
        if not items:
            break
        kinds = {len(it.token_ids) > 1 for it in items}
        mixed_steps += kinds == {True, False}
        rows = runner.compute_logits(items)
        sampled = [i for i, it in zip(owners, items, strict=True) if it.sample]
        for i, row in zip(sampled, rows, strict=True):
            logits[i].append(row)
            outs[i].append(int(row.argmax()))
    assert mixed_steps > 0
    return runner, tables, logits, outs


def check_mixed_equals_alone(source: str, prompts: list[list[int]], atol: float) -> None:
    chunk, steps, block_size = 5, 6, 4
    _, _, mixed_logits, mixed_outs = run_mixed(source, prompts, chunk, steps, block_size)
    config, weights = model(source)
    for i, prompt in enumerate(prompts):
        runner = ModelRunner(
            config, weights, num_blocks=96, block_size=block_size, dtype=torch.float32
        )
        table = list(range(-(-(len(prompt) + steps) // block_size)))
        alone_logits, alone_out = run_alone(runner, prompt, table, chunk=len(prompt), steps=steps)
        assert mixed_outs[i] == alone_out
        torch.testing.assert_close(
            torch.stack(mixed_logits[i]), torch.stack(alone_logits), atol=atol, rtol=0
        )


def test_tiny_mixed_step_equals_alone() -> None:
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 3, 12, 7, 2, 17]
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in lengths]
    check_mixed_equals_alone("tiny", prompts, atol=1e-4)


def test_tiny_execute_returns_none_for_unsampled_chunks() -> None:
    """An unsampled chunk gets None; each sampled item gets its own greedy token, the one it
    gets alone."""
    config, weights = model("tiny")

    def items() -> list[WorkItem]:
        return [
            WorkItem("a", [5, 6, 7], 0, [3], sample=False),
            WorkItem("b", [9], 0, [1]),
            WorkItem("c", [1, 2], 0, [2]),
        ]

    def runner() -> ModelRunner:
        return ModelRunner(config, weights, num_blocks=8, block_size=4, dtype=torch.float32)

    alone = [runner().execute([item])[0] for item in items()[1:]]
    assert runner().execute(items()) == [None, *alone]
    assert len(set(alone)) == 2  # the two differ: a swapped answer would show


def test_short_block_table_is_refused() -> None:
    config, weights = model("tiny")
    runner = ModelRunner(config, weights, num_blocks=8, block_size=4, dtype=torch.float32)
    with pytest.raises(ValueError):
        runner.execute([WorkItem("a", [1, 2, 3, 4, 5], 0, [0])])


@pytest.mark.slow
def test_smollm2_mixed_step_equals_alone() -> None:
    texts = [
        "Hello",
        "The three primary colors are",
        "List two prime numbers:",
        "A haiku about the sea, written by a sailor who misses home:",
    ]
    check_mixed_equals_alone("smollm2", [prompt_ids(t) for t in texts], atol=1e-3)
