"""The reasons the core gives, each defined once with the words the CLI, the metrics and the
docs use for it: why the head of the queue waits (a stall) and why a request is refused at
submit."""

from __future__ import annotations

from enum import StrEnum


class StallReason(StrEnum):
    """Why the head of the queue is not admitted in a step."""

    TOKEN_BUDGET = "token_budget"
    TIME_BUDGET = "time_budget"
    MAX_RUNNING = "max_running"
    KV_CAPACITY = "kv_capacity"
    KV_RESERVED = "kv_reserved"
    STATIC_BATCH = "static_batch"
    WORKER_DOWN = "worker_down"
    # the longest-waiting request is held behind the head by the queue's ordering
    PRIORITY = "priority"
    FAIR_SHARE = "fair_share"
    DEADLINE = "deadline"

    @property
    def description(self) -> str:
        return STALL_TEXT[self]


STALL_TEXT = {
    StallReason.TOKEN_BUDGET: "the execution-token budget is used up this step",
    StallReason.TIME_BUDGET: "the step's predicted time has reached the step-time budget",
    StallReason.MAX_RUNNING: "the running-request limit is reached",
    StallReason.KV_CAPACITY: "the KV data itself would not fit",
    StallReason.KV_RESERVED: "the data would fit, but reservations hold the space",
    StallReason.STATIC_BATCH: "static batching: waiting for the batch to drain",
    StallReason.WORKER_DOWN: "only failed workers can hold it: waiting for one to come back",
    StallReason.PRIORITY: "the oldest waiting request is behind requests of higher priority",
    StallReason.FAIR_SHARE: "the oldest waiting request's tenant has had more than its share",
    StallReason.DEADLINE: "the oldest waiting request is behind earlier deadlines that can be met",
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
