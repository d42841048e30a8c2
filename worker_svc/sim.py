"""A simulated model for measuring the control plane: an execution takes a set time (a fixed
part plus a part per token) without computing, and samples deterministic tokens, so GPU-class
step times run through the real processes on a CPU."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from worker_svc.model_config import ModelConfig, tiny_config
from worker_svc.work import WorkItem

FIRST_TOKEN, SPREAD = 1000, 2000  # sampled ids: ordinary vocabulary, never a stop token


def sim_config(max_context: int = 8192) -> ModelConfig:
    """SmolLM2's vocabulary and stop token (the gateway's tokenizer), nothing computed."""
    return replace(tiny_config(), name="sim", max_context=max_context)


def sim_token(item: WorkItem) -> int:
    """The next token of an item: a function of its last token and position only, so a request
    recomputed elsewhere samples the same tokens, whatever the batch."""
    last, position = item.token_ids[-1], item.end_position
    seed = item.sampling.seed or 0
    return FIRST_TOKEN + (last * 7919 + position * 104729 + seed) % SPREAD


@dataclass(slots=True)
class SimPool:
    num_blocks: int
    block_size: int
    bytes_per_position: int = 0
    pool_bytes: int = 0


class SimRunner:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        step_seconds: float,
        token_seconds: float = 0.0,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pool = SimPool(num_blocks, block_size)
        self.step_seconds = step_seconds
        self.token_seconds = token_seconds

    def seconds(self, items: list[WorkItem]) -> float:
        return self.step_seconds + self.token_seconds * sum(len(i.token_ids) for i in items)

    def execute(self, items: list[WorkItem]) -> list[int | None]:
        deadline = time.perf_counter() + self.seconds(items)
        for item in items:
            self.check(item)
        out = [sim_token(i) if i.sample else None for i in items]
        left = deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return out

    def check(self, item: WorkItem) -> None:
        end = item.end_position
        if not item.token_ids or end > self.config.max_context:
            raise ValueError(f"{item.request_id}: no tokens, or positions beyond the context")
        if len(item.block_table) * self.block_size < end:
            raise ValueError(f"{item.request_id}: block table too short for position {end - 1}")
