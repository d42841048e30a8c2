"""Settings of the scheduling core, and the reasons it gives: why the head of the queue waits
(a stall) and why a request is refused at submit. Each is defined here once, with the words
the CLI, the metrics and the docs use for it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from llmserve.runtime.flags import setting


class KvPolicy(StrEnum):
    RESERVE = "reserve"  # reserve prompt + max_tokens at admission
    PAGED = "paged"  # allocate blocks as KV grows; preempt when out of blocks


class BatchMode(StrEnum):
    CONTINUOUS = "continuous"  # the batch changes between executions
    STATIC = "static"  # nothing joins until the whole batch has finished


class StallReason(StrEnum):
    """Why the head of the queue is not admitted in a step."""

    TOKEN_BUDGET = "token_budget"
    MAX_RUNNING = "max_running"
    KV_CAPACITY = "kv_capacity"
    KV_RESERVED = "kv_reserved"
    STATIC_BATCH = "static_batch"

    @property
    def description(self) -> str:
        return STALL_TEXT[self]


STALL_TEXT = {
    StallReason.TOKEN_BUDGET: "the execution-token budget is used up this step",
    StallReason.MAX_RUNNING: "the running-request limit is reached",
    StallReason.KV_CAPACITY: "the KV data itself would not fit",
    StallReason.KV_RESERVED: "the data would fit, but reservations hold the space",
    StallReason.STATIC_BATCH: "static batching: waiting for the batch to drain",
}


class RefusalReason(StrEnum):
    """Why a request is refused at submit: it could never run as asked."""

    CONTEXT = "context"
    KV_CAPACITY = "kv_capacity"
    TOKEN_BUDGET = "token_budget"
    DUPLICATE = "duplicate"
    NO_WORKER = "no_worker"

    @property
    def description(self) -> str:
        return REFUSAL_TEXT[self]


REFUSAL_TEXT = {
    RefusalReason.CONTEXT: "the prompt leaves no room to generate within the model's context",
    RefusalReason.KV_CAPACITY: "prompt + max_tokens need more KV than any worker's pool holds",
    RefusalReason.TOKEN_BUDGET: "the prompt exceeds the token budget and chunked prefill is off",
    RefusalReason.DUPLICATE: "a request with this id is already in flight",
    RefusalReason.NO_WORKER: "no live worker: none has joined, or all are down or draining",
}


@dataclass(frozen=True, slots=True)
class CoreConfig:
    token_budget: int = setting(256, "new tokens processed in one execution, per worker")
    max_running: int = setting(32, "running requests per worker")
    policy: KvPolicy = setting(
        KvPolicy.PAGED,
        "KV allocation: reserve prompt+max_tokens at admission, or paged as it grows",
    )
    mode: BatchMode = setting(BatchMode.CONTINUOUS, "continuous batching, or static (the baseline)")
    chunked_prefill: bool = setting(True, "split long prompts across steps to fit the token budget")
    prefix_caching: bool = setting(
        True,
        "reuse the KV blocks of prompt prefixes computed before (paged only: reserve sets aside "
        "whole requests, so it leaves it off)",
    )

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
