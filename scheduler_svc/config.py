"""Settings of the scheduling core (the reasons it gives live in `scheduler_svc.reasons`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from llmcommon.flags import setting


class KvPolicy(StrEnum):
    RESERVE = "reserve"  # reserve prompt + max_tokens at admission
    PAGED = "paged"  # allocate blocks as KV grows; preempt when out of blocks


class BatchMode(StrEnum):
    CONTINUOUS = "continuous"  # the batch changes between executions
    STATIC = "static"  # nothing joins until the whole batch has finished


class QueuePolicy(StrEnum):
    """The waiting queue's ordering (one RequestQueue class each, request_queue.py)."""

    FCFS = "fcfs"  # the seed's: first come, first served
    PRIORITY = "priority"  # lower priority value first, ties by arrival; preempts lower ones
    FAIR = "fair"  # within a priority level, the tenant served least (VTC), by weight
    DEADLINE = "deadline"  # earliest TTFT deadline that can still be met first


class Speculative(StrEnum):
    """Speculative decoding's proposer (scheduler_svc/speculation/)."""

    OFF = "off"
    NGRAM = "ngram"  # prompt lookup in the request's own prompt and output (vLLM's ngram)
    SUFFIX = "suffix"  # a suffix index over recent requests' tokens, per prefix-cache salt
    NGRAM_SUFFIX = "ngram+suffix"  # prompt lookup; the suffix index where it finds nothing


class DecodeRuns(StrEnum):
    """When a decode-only step runs several executions (--decode-steps at most)."""

    AUTO = "auto"  # where the loop's measured time outside the forward outweighs the arrivals held
    FIXED = "fixed"  # always --decode-steps (the remaining lengths and the run limit allowing)


class DraftLength(StrEnum):
    FIXED = "fixed"  # --num-speculative-tokens whenever the proposal is that long
    AUTO = "auto"  # per step, what maximises expected tokens per predicted second


MAX_TIME_WINDOW = 64  # steps: --step-time-window's largest
MAX_COUNT = 2**32 - 1  # token_budget and max_running: uint32 in the status and explain replies
MAX_DECODE_STEPS = 32  # executions: --decode-steps's largest
MAX_SPECULATIVE_TOKENS = 16  # --num-speculative-tokens's largest
# the longest n-gram a proposer matches: the suffix index keeps an entry per n per position
# (its memory and the time adding a finished request takes on the step loop grow as max^2)
MAX_LOOKUP = 8


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
    step_time_budget_ms: float = setting(
        0.0,
        "the longest a worker's step may be predicted to take (its online step-time model): "
        "decodes always run, admissions and prompt chunks join only while the prediction stays "
        "within it, a chunk is cut to fit; the token budget stays the cap; 0 = off",
    )
    step_time_window: int = setting(
        1,
        "the steps of a worker over which the step-time budget holds on average, as predicted: "
        "a step may take what the last window-1 steps left of window x budget (a long prompt "
        "chunk after short decode steps); 1 = every step within the budget",
    )
    decode_steps: int = setting(
        8,
        "the most executions a worker runs in one step when its batch only decodes and no "
        "request waits: each feeds the token it sampled to the next, and their tokens come "
        "back together (less scheduling and messaging per token; a request arriving meanwhile "
        "waits for the run's end; requests asking for logprobs or structured output run one "
        "per step); how many, --decode-runs; 1 = one execution per step",
    )
    decode_runs: DecodeRuns = setting(
        DecodeRuns.AUTO,
        "decode runs' length: auto (as long as the loop's measured time outside the forward, "
        "saved for every row, outweighs the arrivals the run holds back, by the worker's "
        "step-time model and the recent arrival rate; none where the loop costs nothing "
        "beside the forward), fixed (always --decode-steps)",
    )

    queue_policy: QueuePolicy = setting(
        QueuePolicy.FCFS,
        "the waiting queue's order: fcfs (arrival), priority (lower value first, ties by "
        "arrival; a waiting request preempts a lower-priority running one when KV or the "
        "running limit is short), fair (the least-served tenant first by weighted tokens, VTC, "
        "within a priority level), deadline (the earliest TTFT deadline that can still be met "
        "first; those past theirs after, still served)",
    )
    speculative: Speculative = setting(
        Speculative.OFF,
        "speculative decoding: running requests decode with a draft that the worker verifies "
        "in one execution: ngram (prompt lookup in the request's own prompt and output), "
        "suffix (an index over recent requests' tokens, per prefix-cache salt), ngram+suffix "
        "(prompt lookup, the index where it finds nothing); the output is the same as without",
    )
    num_speculative_tokens: int = setting(
        5, "the longest draft a request takes in one step (speculative decoding)"
    )
    speculative_length: DraftLength = setting(
        DraftLength.AUTO,
        "draft lengths: auto (each step, from the requests' acceptance rates and the worker's "
        "step-time model, what maximises expected tokens per predicted second; 0 under load), "
        "fixed (the longest the proposal and the limits allow)",
    )
    prompt_lookup_min: int = setting(
        5, "the shortest n-gram of a request's end that a proposer matches (vLLM's name)"
    )
    prompt_lookup_max: int = setting(
        5,
        f"the longest n-gram of a request's end that a proposer matches, tried first (at most "
        f"{MAX_LOOKUP})",
    )
    speculation_potential: bool = setting(
        True,
        "replay finished requests' outputs against prompt lookup (at the settings above) and an "
        "oracle (the longest stretch found earlier in the request): the tokens per step "
        "speculation would emit on this traffic, speculating or not (metrics "
        "spec_potential_*, status); a hundredth of the step loop's time at most",
    )

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_running"):  # uint32 on the wire (status, explain)
            if not 1 <= getattr(self, name) <= MAX_COUNT:
                raise ValueError(f"{name} must be 1 to {MAX_COUNT}, got {getattr(self, name)}")
        if not 0 <= self.step_time_budget_ms < math.inf:  # NaN fails it too
            raise ValueError(
                f"step_time_budget_ms must be a finite number >= 0 (0 = off), got "
                f"{self.step_time_budget_ms}"
            )
        if not 1 <= self.step_time_window <= MAX_TIME_WINDOW:
            raise ValueError(
                f"step_time_window must be 1 to {MAX_TIME_WINDOW}, got {self.step_time_window}"
            )
        if not 1 <= self.decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(
                f"decode_steps must be 1 to {MAX_DECODE_STEPS}, got {self.decode_steps}"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be 1 to {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min {self.prompt_lookup_min} and prompt_lookup_max "
                f"{self.prompt_lookup_max}: need 1 <= min <= max"
            )
        if self.prompt_lookup_max > MAX_LOOKUP:
            raise ValueError(
                f"prompt_lookup_max must be at most {MAX_LOOKUP}, got {self.prompt_lookup_max} "
                f"(the suffix index's memory and work grow with its square)"
            )
        object.__setattr__(self, "speculative", Speculative(self.speculative))
        object.__setattr__(self, "speculative_length", DraftLength(self.speculative_length))
        object.__setattr__(self, "decode_runs", DecodeRuns(self.decode_runs))
        object.__setattr__(self, "policy", KvPolicy(self.policy))
        object.__setattr__(self, "mode", BatchMode(self.mode))
        object.__setattr__(self, "queue_policy", QueuePolicy(self.queue_policy))


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
