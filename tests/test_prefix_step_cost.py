"""The prefix cache's work per step is bounded by the step's tokens, never by a prompt's length or
by how much is cached (issue 20, item 13). Counted, not timed: the BLAKE2b calls of the block keys
and the cache lookups of `BlockPool.match`, step by step, in a steady state where requests of
long prompts (sharing a short system prompt) are admitted as others finish."""

from __future__ import annotations

import itertools
import types

import pytest

import llmcommon.block_keys as blocks_module  # (the block keys the pool hashes with)
from scheduler_svc.blocks import BlockPool, block_keys, common_blocks
from scheduler_svc.config import CoreConfig, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.kv import HIT_BATCH
from scheduler_svc.sequence import Sequence

BS = 16
BUDGET = 256
SHARED = [5000 + i for i in range(4 * BS)]  # a system prompt of four blocks


class Counts:
    """Counting wrappers: hash calls (every BLAKE2b of the pool's keys) and cache lookups."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hashes = self.lookups = 0
        real_hashlib, real_match = blocks_module.hashlib, BlockPool.match

        def blake2b(*args: object, **kwargs: object):
            self.hashes += 1
            return real_hashlib.blake2b(*args, **kwargs)

        def match(pool: BlockPool, keys: list[bytes]) -> list[int]:
            found = real_match(pool, keys)
            self.lookups += min(len(keys), len(found) + 1)  # up to the first miss
            return found

        monkeypatch.setattr(blocks_module, "hashlib", types.SimpleNamespace(blake2b=blake2b))
        monkeypatch.setattr(BlockPool, "match", match)

    def take(self) -> tuple[int, int]:
        got, self.hashes, self.lookups = (self.hashes, self.lookups), 0, 0
        return got


class Steady:
    """One worker, four running, a queue that never empties; every request is the shared
    prefix and `own` tokens of its own (or, with `repeat`, the same prompt every time)."""

    def __init__(self, own: int, num_blocks: int = 4096, repeat: bool = False) -> None:
        self.own, self.repeat = own, repeat
        spec = WorkerSpec("w0", num_blocks, BS, 65536)
        config = CoreConfig(token_budget=BUDGET, max_running=4, prefix_caching=True)
        self.core = Scheduler(config, [spec], clock=lambda: 0.0)
        self.ids = itertools.count()
        for _ in range(6):
            self.add()

    def add(self) -> None:
        n = next(self.ids)
        seed = 0 if self.repeat else n
        own = [(seed * 7919 + i) % 40_000 + 10 for i in range(self.own)]
        self.core.add(Sequence(str(n), SHARED + own, 4, arrival=1.0))

    def step(self) -> None:
        finished = 0
        for step in self.core.schedule_all():
            finished += len(self.core.complete(step, [7] * step.num_sampled).finishes)
        for _ in range(finished):
            self.add()

    def run(self, counts: Counts, warm: int, steps: int) -> list[tuple[int, int, int]]:
        """Per step: (hash calls, cache lookups, requests admitted)."""
        for _ in range(warm):
            self.step()
        counts.take()
        per_step = []
        for _ in range(steps):
            admitted = self.core.admitted
            self.step()
            per_step.append((*counts.take(), self.core.admitted - admitted))
        return per_step


def test_hashes_per_step_do_not_grow_with_the_prompt_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts = Counts(monkeypatch)
    short = Steady(own=1024).run(counts, warm=40, steps=120)
    long = Steady(own=4096).run(counts, warm=40, steps=120)
    most_short = max(h for h, _, _ in short)
    most_long = max(h for h, _, _ in long)
    # a step hashes the blocks its chunks fill and, for an admission, what finds its cache hit
    bound = BUDGET // BS + HIT_BATCH + 1
    assert 0 < most_short <= bound and 0 < most_long <= bound, (most_short, most_long)
    # still every block is hashed once: the long prompts' steps hash as many tokens a step
    assert sum(h for h, _, _ in long) >= sum(h for h, _, _ in short) * 0.9


def test_a_full_worker_looks_up_nothing_however_much_of_the_head_is_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The head of the queue waits for the running limit: its cache hit is not looked up step
    after step (it was, over its whole cached prefix: work in proportion to what is cached)."""
    counts = Counts(monkeypatch)
    waiting_steps = {}
    for own in (512, 2048):
        state = Steady(own=own, repeat=True)  # every prompt the same: the head's fully cached
        per_step = state.run(counts, warm=30, steps=60)
        kv = state.core.snapshot().workers[0]
        assert kv.hit_tokens > kv.prompt_tokens // 2  # admissions do find the whole prompt
        waiting_steps[own] = [lookups for _, lookups, admitted in per_step if not admitted]
        assert len(waiting_steps[own]) >= 10 and state.core.stalls["max_running"] >= 10
    assert waiting_steps[512] == waiting_steps[2048]
    assert set(waiting_steps[2048]) == {0}


def test_common_blocks_counts_the_equal_leading_blocks() -> None:
    base = list(range(1000, 1000 + 40 * BS))
    for differs_at in (0, 1, 15, 16, 17, 31 * BS + 3, 32 * BS, 33 * BS, 39 * BS + 15):
        other = base.copy()
        other[differs_at] = -1
        assert common_blocks(base, other, BS, 40) == differs_at // BS
        assert common_blocks(base, other, BS, 2) == min(2, differs_at // BS)
    assert common_blocks(base, base.copy(), BS, 40) == 40
    assert common_blocks(base, base[: 10 * BS], BS, 10) == 10


def test_a_prompt_that_repeats_a_recent_ones_prefix_reuses_its_keys_unhashed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keys are a function of the salt and the tokens, so a new request whose first blocks equal
    a recent request's (compared id for id) takes those keys: it hashes only what differs,
    and its keys are exactly those hashing would give."""
    counts = Counts(monkeypatch)
    spec = WorkerSpec("w0", 4096, BS, 65536)
    config = CoreConfig(token_budget=4096, max_running=4, prefix_caching=True)
    core = Scheduler(config, [spec], clock=lambda: 0.0)
    document = [7000 + i % 501 for i in range(100 * BS)]  # 100 blocks, shared
    first = Sequence("a", document + [1] * BS, 2, arrival=1.0)
    core.add(first)
    for step in core.schedule_all():
        core.complete(step, [7] * step.num_sampled)
    counts.take()
    second = Sequence("b", document + [2] * (3 * BS), 2, arrival=1.0, cache_salt=b"")
    core.add(second)
    core.schedule_all()
    hashes, _ = counts.take()
    assert hashes <= 1 + 3 + 1  # its first block, its own three, the last one's lookup
    keys = core.kv_records.of(second).keys
    assert keys == block_keys(second.prompt_ids, BS, [], len(keys))
    assert core.snapshot().workers[0].hit_tokens >= 100 * BS
    # another salt shares nothing: every block hashed anew
    third = Sequence("c", document + [2] * (3 * BS), 2, arrival=1.0, cache_salt=b"tenant")
    core.add(third)
    core.schedule_all()
    assert counts.take()[0] >= 100
