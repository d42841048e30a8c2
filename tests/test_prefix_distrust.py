"""A failed chunk leaves nothing behind in the prefix cache (issue 20, item 2): with overlap a
request is admitted onto blocks whose step has not been verified yet and fills blocks of its own
over them; when that step fails, everything computed over the failed KV, by any request and
transitively, leaves the cache, and a key cached again never keeps a stale block.

`KvTruth` is the oracle: it executes the planned steps in order as a worker would and knows
which blocks hold wrong KV (a failed item's writes, and every position written over a wrong
block of the same table, since attention reads all earlier positions). No token the core
accepts may come from wrong KV."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.blocks import BlockPool, block_keys
from scheduler_svc.config import CoreConfig, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.sequence import Finish, Sequence
from scheduler_svc.step import Step
from tests.sim import check_invariants, sample
from tests.test_prefix_core import BS, PROMPT, core_of, req

Write = tuple[Sequence, int, list[int], int, int]  # seq, handle, its table, start, end


class KvTruth:
    """Which blocks of one worker's pool hold wrong KV, step by step."""

    def __init__(self, core: Scheduler, worker: int = 0) -> None:
        self.core, self.worker = core, worker
        self.wrong: set[int] = set()

    def writes(self, step: Step) -> list[Write]:
        """What a step just planned writes: read its tables now, before anything changes them."""
        pool = self.core.workers[self.worker].kv.pool
        out = [
            (w.seq, w.handle, list(pool.table(w.seq.request_id)), w.start, w.start + w.num_tokens)
            for w in step.chunks
        ]
        for seq, handle in zip(step.decodes, step.decode_handles, strict=True):
            end = seq.num_computed
            out.append((seq, handle, list(pool.table(seq.request_id)), end - 1, end))
        return out

    def execute(self, writes: list[Write], failed: set[int]) -> set[int]:
        """Run the writes; the handles whose work was computed over wrong KV."""
        over_wrong: set[int] = set()
        for _, handle, table, start, end in writes:
            first, last = start // BS, (end - 1) // BS
            read = table[:first] + ([table[first]] if start % BS else [])
            bad = handle in failed or not self.wrong.isdisjoint(read)
            if bad and handle not in failed:
                over_wrong.add(handle)
            for block in table[first : last + 1]:
                (self.wrong.add if bad else self.wrong.discard)(block)
        return over_wrong


class FailingDriver:
    """One worker with two steps in flight (the service's overlap); the items `fails` picks
    fail when their step completes. Asserts that no token is accepted from wrong KV."""

    def __init__(self, core: Scheduler, fails) -> None:
        self.core, self.fails = core, fails
        self.truth = KvTruth(core)
        self.inflight: list[tuple[Step, list[Write]]] = []
        self.failures = 0

    def tick(self) -> None:
        step = self.core.schedule(0)
        check_invariants(self.core)
        self.inflight.append((step, self.truth.writes(step)))
        if len(self.inflight) == 2:
            self.complete_oldest()

    def complete_oldest(self) -> None:
        step, writes = self.inflight.pop(0)
        failed = {h: "boom" for h in self.fails(step)}
        over_wrong = self.truth.execute(writes, set(failed))
        if failed:
            self.failures += 1
            self.core.fail_items(step, failed, "w")
        check_invariants(self.core)
        kept = {seq.request_id for seq, handle, *_ in writes if seq.handle == handle}
        read_wrong = {seq.request_id for seq, h, *_ in writes if h in over_wrong}
        assert not kept & read_wrong, f"{kept & read_wrong} go on from wrong KV"
        self.core.complete(step, sample(step))
        check_invariants(self.core)


def no_failures(step: Step) -> list[int]:
    return []


def test_a_request_admitted_onto_a_failed_chunk_caches_nothing_it_filled_over_it() -> None:
    """The issue's case: X computes its prompt (2 full blocks) in step 1; B, which starts with
    those blocks, is admitted in step 2 onto them and fills block 2 of its own; step 1 fails.
    Neither X's blocks nor B's stay cached; B recomputes, and a later request with B's prompt
    starts from what B recomputed, never from the block it filled over the failure."""
    core = core_of(token_budget=16)
    core.add(req("X", PROMPT[:9], 3))
    first = core.schedule(0)
    b = req("B", PROMPT[:8] + [1, 2, 3, 4, 5], 3)
    core.add(b)
    second = core.schedule(0)
    pool = core.workers[0].kv.pool
    [(_, shared)] = second.shares
    filled = pool.table("B")[2]
    assert shared == pool.table("X")[:2] and pool.key_of[filled] == core.kv_records.of(b).keys[2]
    core.fail_items(first, {first.chunks[0].handle: "boom"}, "w")
    check_invariants(core)
    assert pool.cached == {} and filled not in pool.key_of
    assert b.preemptions == 1 and list(core.waiting) == [b]
    core.complete(first, [])
    core.complete(second, sample(second))
    driver = FailingDriver(core, no_failures)
    while core.waiting or core.workers[0].running:
        driver.tick()
    assert b.finish is Finish.LENGTH
    core.add(req("D", b.prompt_ids + [6], 3))
    driver.tick()
    d_table = pool.table("D")
    assert (
        d_table[:3] == [pool.cached[k] for k in core.kv_records.of(b).keys[:3]]
        and filled not in d_table
    )
    assert not driver.truth.wrong & set(d_table)


def test_distrust_is_transitive_through_blocks_other_requests_filled() -> None:
    """Three steps planned before the first completes: X's chunk (step 1), B over X's blocks
    (step 2), D over the block B filled (step 3). X's chunk fails: B and D go back to the
    queue, and nothing any of them cached stays."""
    core = core_of(token_budget=16)
    core.add(req("X", PROMPT[:9], 3))
    steps = [core.schedule(0)]
    b = req("B", PROMPT[:8] + [1, 2, 3, 4, 5], 3)
    core.add(b)
    steps.append(core.schedule(0))
    d = req("D", b.prompt_ids[:12] + [7, 7, 7, 7, 7], 3)
    core.add(d)
    steps.append(core.schedule(0))
    pool = core.workers[0].kv.pool
    assert [s.seq.request_id for s in steps[2].chunks] == ["D"]
    assert steps[2].shares[0][1] == pool.table("B")[:3]  # X's two blocks and B's own
    d_own = pool.table("D")[3]
    assert pool.key_of[d_own] == core.kv_records.of(d).keys[3]
    core.fail_items(steps[0], {steps[0].chunks[0].handle: "boom"}, "w")
    assert pool.cached == {} and not pool.evictable
    assert list(core.waiting) == [b, d] and b.preemptions == d.preemptions == 1


def test_a_reader_cancelled_before_the_failure_is_known_caches_nothing_when_it_leaves() -> None:
    core = core_of(token_budget=16)
    core.add(req("X", PROMPT[:9], 3))
    first = core.schedule(0)
    b = req("B", PROMPT[:8] + [1, 2, 3, 4, 5], 3)
    core.add(b)
    second = core.schedule(0)
    core.abort("B")
    core.fail_items(first, {first.chunks[0].handle: "boom"}, "w")
    check_invariants(core)
    assert b.finish is Finish.CANCELLED and b not in core.waiting
    core.complete(first, [])
    core.complete(second, sample(second))
    core.schedule(0)  # B leaves its worker
    check_invariants(core)
    assert core.workers[0].kv.pool.cached == {}


def test_a_key_cached_again_in_another_block_replaces_the_old_one() -> None:
    """The newest block computed for a key is the one the cache names; the old one keeps its
    holders but no key, and is plainly free once nobody holds it."""
    pool = BlockPool(num_blocks=4, block_size=2)
    [key] = block_keys([1, 2], 2, [], 1)
    [old] = pool.grow("a", 2)
    pool.cache(old, key)
    pool.fresh.clear()
    pool.release("a")  # evictable
    [new] = pool.grow("b", 2)
    assert new != old
    pool.cache(new, key)
    pool.fresh.clear()
    assert pool.cached == {key: new} and pool.key_of == {new: key}
    assert old not in pool.evictable and old in pool.free and pool.num_free == 3
    assert pool.match([key]) == [new]
    [held] = pool.grow("c", 2)
    pool.cache(held, key)  # while "b" still holds `new`
    assert pool.cached == {key: held} and new not in pool.key_of
    assert pool.tables["b"] == [new] and pool.refs[new] == 1
    pool.release("b")
    assert new in pool.free and new not in pool.evictable


def test_caching_a_block_under_the_key_it_already_has_changes_nothing() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    [key] = block_keys([1, 2], 2, [], 1)
    [block] = pool.grow("a", 2)
    pool.cache(block, key)
    pool.fresh.clear()
    pool.cache(block, key)
    assert pool.cached == {key: block} and not pool.fresh


@pytest.mark.search
@pytest.mark.parametrize("seed", range(12))
def test_randomized_failures_never_let_wrong_kv_reach_a_token(seed: int) -> None:
    """Conversations (each request mostly resends one of the last two prompts and adds to it),
    two steps in flight, chunks failing at random: every token the core keeps is computed over
    right KV (the oracle), and every invariant holds."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 900) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    core = Scheduler(
        CoreConfig(token_budget=rng.choice([16, 24, 32]), max_running=6),
        [WorkerSpec("w", 200, BS, 64)],
    )

    def fails(step: Step) -> list[int]:
        return [w.handle for w in step.chunks if rng.random() < 0.15]

    driver = FailingDriver(core, fails)
    sent: list[list[int]] = []
    for i in range(600):
        if i < 300 and rng.random() < 0.5:
            start = rng.choice(sent[-2:]) if sent and rng.random() < 0.9 else rng.choice(prefixes)
            prompt = start + [rng.randrange(3, 900) for _ in range(rng.randrange(7))]
            sent.append(prompt[:40])
            core.add(req(f"r{i}", prompt[:40], rng.randrange(1, 6)))
        driver.tick()
    while core.waiting or core.workers[0].running:
        driver.tick()
    assert driver.failures > 0
    assert core.workers[0].hit_tokens > 0
