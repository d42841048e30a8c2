"""Settings of the scheduling core."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class KvPolicy(StrEnum):
    RESERVE = "reserve"  # reserve prompt + max_tokens at admission
    PAGED = "paged"  # allocate blocks as KV grows; preempt when out of blocks


class BatchMode(StrEnum):
    CONTINUOUS = "continuous"  # the batch changes between executions
    STATIC = "static"  # nothing joins until the whole batch has finished


class StallReason(StrEnum):
    TOKEN_BUDGET = "token_budget"
    MAX_RUNNING = "max_running"
    KV_CAPACITY = "kv_capacity"  # the actual data would not fit
    KV_RESERVED = "kv_reserved"  # the data would fit, but reservations hold the space
    STATIC_BATCH = "static_batch"  # waiting for the static batch to drain


@dataclass(frozen=True, slots=True)
class CoreConfig:
    token_budget: int = 256  # new tokens processed in one execution (per worker)
    max_running: int = 32  # running requests (per worker)
    policy: KvPolicy = KvPolicy.PAGED
    mode: BatchMode = BatchMode.CONTINUOUS
    chunked_prefill: bool = True
    prefix_caching: bool = True  # share cached prefix blocks (paged only: see core.Scheduler)

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        object.__setattr__(self, "policy", KvPolicy(self.policy))
        object.__setattr__(self, "mode", BatchMode(self.mode))


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What the scheduler knows of a worker's KV pool (from its Describe report)."""

    name: str
    num_blocks: int
    block_size: int
    max_context: int

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size
