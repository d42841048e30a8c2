"""A simulated model for measuring the control plane: an execution takes a set time (a fixed
part plus a part per token) without computing, and samples deterministic tokens, so GPU-class
step times run through the real processes on a CPU.

Its model: flat logits (0) over SPREAD ordinary tokens, OFF_SPREAD for every other token; the
draw among equals is a hash of the request's last token, position and seed (the "sampled" order
starts there and runs round the spread). What decides when a request ends and what it returns is
honoured as a real worker honours it: logit_bias (added to those logits, so +100 forces a token),
min_tokens (the stop ids masked until then) and logprobs (of those raw logits). Temperature,
top_p, top_k and min_p only reshape a draw among equals, which the hash makes; the penalties are
not applied (they would only move the draw to another of the equal tokens).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from worker_svc import verify
from worker_svc.model_config import ModelConfig, tiny_config
from worker_svc.work import TokenLogprobs, WorkItem

FIRST_TOKEN, SPREAD = 1000, 2000  # sampled ids: ordinary vocabulary, never a stop token
OFF_SPREAD = -30.0  # the logit of every token outside the spread


def sim_config(max_context: int = 8192) -> ModelConfig:
    """SmolLM2's vocabulary and stop token (the gateway's tokenizer), nothing computed."""
    return replace(tiny_config(), name="sim", max_context=max_context)


def sim_token(item: WorkItem) -> int:
    """The next token of an item: a function of its last token and position only, so a request
    recomputed elsewhere samples the same tokens, whatever the batch."""
    last, position = item.token_ids[-1], item.end_position
    seed = item.sampling.seed or 0
    return FIRST_TOKEN + (last * 7919 + position * 104729 + seed) % SPREAD


def sim_choice(item: WorkItem, vocab_size: int) -> int:
    """The argmax of the sim's logits plus the request's logit_bias, its stop ids masked before
    min_tokens; ties go to the first in the hash's order round the spread."""
    s, start = item.sampling, sim_token(item)
    masked = set(s.stop_token_ids) if item.sample_index < s.min_tokens else set()
    untouched = (  # the spread, in that order, less what a setting touches
        t
        for k in range(SPREAD)
        if (t := FIRST_TOKEN + (start - FIRST_TOKEN + k) % SPREAD) not in masked
        and t not in s.logit_bias
    )
    candidates = [t for t in s.logit_bias if t not in masked and t < vocab_size]
    candidates += [t for t in (next(untouched, None),) if t is not None]

    def rank(t: int) -> tuple[float, int]:
        order = (t - start) % SPREAD if in_spread(t) else SPREAD + t
        return -(raw_logit(t) + s.logit_bias.get(t, 0.0)), order

    return min(candidates, key=rank)


def in_spread(token: int) -> bool:
    return FIRST_TOKEN <= token < FIRST_TOKEN + SPREAD


def raw_logit(token: int) -> float:
    return 0.0 if in_spread(token) else OFF_SPREAD


def sim_logprobs(token: int, start: int, top: int, vocab_size: int) -> TokenLogprobs:
    """The log-softmax of the raw logits (no bias, no mask, as a real worker returns it): the
    token's, and the `top` most likely, the spread's tokens in the hash's order."""
    log_z = math.log(SPREAD + (vocab_size - SPREAD) * math.exp(OFF_SPREAD))
    ids = tuple(FIRST_TOKEN + (start - FIRST_TOKEN + k) % SPREAD for k in range(top))
    return TokenLogprobs(raw_logit(token) - log_z, ids, (-log_z,) * top)


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
        out = [
            (self.verify(i) if i.drafted else self.sample(i)) if i.sample else None for i in items
        ]
        left = deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return out

    def sample(self, item: WorkItem) -> int:
        vocab, top = self.config.vocab_size, item.sampling.logprobs
        token = sim_choice(item, vocab)
        if top is not None:
            item.logprobs = sim_logprobs(token, sim_token(item), top, vocab)
        return token

    def verify(self, item: WorkItem) -> int:
        """A draft, as a real worker verifies one (verify.py): position by position, the sim's
        token there, kept while it is the draft's next one."""
        item.emitted = []
        for depth in range(item.drafted + 1):
            at = item.fed - 1 + depth
            view = replace(
                item,
                token_ids=[item.token_ids[at]],
                start_position=item.start_position + at,
                sample_index=item.sample_index + depth,
                drafted=0,
            )
            token = self.sample(view)
            item.emitted.append((token, view.logprobs))
            if depth == item.drafted or not verify.kept(item, depth, token):
                break
        token, item.logprobs = item.emitted[-1]
        return token

    def check(self, item: WorkItem) -> None:
        end = item.end_position
        if not item.token_ids or end > self.config.max_context:
            raise ValueError(f"{item.request_id}: no tokens, or positions beyond the context")
        if len(item.block_table) * self.block_size < end:
            raise ValueError(f"{item.request_id}: block table too short for position {end - 1}")
