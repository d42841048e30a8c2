"""The prefix cache's rules that a mutation run found unpinned: how keys are extended, which
blocks a failure takes out of the cache, which blocks stay cached when a request leaves or is
preempted, keys after a move to a pool of another block size, and evictions across pools."""

from __future__ import annotations

import pytest

from scheduler_svc.blocks import BlockPool, block_keys
from scheduler_svc.config import CoreConfig, WorkerSpec
from scheduler_svc.sequence import Finish
from tests.sim import Recording, check_invariants, step
from tests.test_prefix_core import BS, PROMPT, core_of, first_chunk, req, run


def test_keys_extended_a_few_blocks_at_a_time_equal_keys_computed_at_once() -> None:
    tokens = list(range(40, 60))
    once = block_keys(tokens, BS, [], 5)
    stepwise: list[bytes] = []
    for upto in (1, 3, 3, 5):
        block_keys(tokens, BS, stepwise, upto)
    assert stepwise == once and len(set(once)) == 5


def test_uncaching_a_block_nobody_holds_makes_it_plainly_free() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    blocks = pool.grow("a", 4)
    for block, key in zip(blocks, block_keys([1, 2, 3, 4], 2, [], 2), strict=True):
        pool.cache(block, key)
    pool.fresh.clear()
    pool.release("a")  # both evictable
    pool.uncache(blocks)
    assert pool.num_free == 2 and not pool.evictable and not pool.cached
    assert sorted(pool.grow("b", 4)) == sorted(blocks) and pool.evictions == 0


def test_a_prompt_one_token_past_a_block_reuses_that_block() -> None:
    core = core_of()
    core.add(req("A", PROMPT[:4] + [9]))
    run(core)
    core.add(req("B", PROMPT[:4] + [7]))
    _, work = first_chunk(core, "B")
    assert (work.start, work.num_tokens) == (4, 1)


def test_a_failed_chunk_takes_the_blocks_of_its_later_chunks_out_of_the_cache_too() -> None:
    """With overlap, A's second chunk is planned (and its blocks cached) before its first is
    known to have failed: the second was computed over the first's KV, so neither may stay."""
    core = core_of(token_budget=8)
    core.add(req("A", PROMPT, 5))  # 20 tokens: chunks of 8
    first = core.schedule(0)
    second = core.schedule(0)
    assert [(w.start, w.num_tokens) for w in second.chunks] == [(8, 8)]
    assert len(core.workers[0].kv.pool.cached) == 4  # A's first four blocks
    core.fail_items(first, {first.chunks[0].handle: "boom"}, "w")
    check_invariants(core)
    assert core.workers[0].kv.pool.cached == {}


def test_a_resent_conversation_finds_the_blocks_of_the_answer_too() -> None:
    """A finishes; B sends A's prompt and answer and one more token: B's first chunk starts
    past the blocks A's decodes filled, not only past A's prompt."""
    core = core_of()
    core.add(req("A", PROMPT[:8], 9))
    answer = run(core)["A"]
    core.add(req("B", PROMPT[:8] + answer + [5]))  # 18 tokens: 4 full blocks before the last
    _, work = first_chunk(core, "B")
    assert (work.start, work.num_tokens) == (16, 2)
    assert core.snapshot().workers[0].hit_tokens == 16


def test_a_request_that_failed_leaves_nothing_in_the_cache_its_decodes_filled() -> None:
    core = core_of()
    core.add(req("A", PROMPT[:8], 9))
    for _ in range(6):  # the prompt and five decodes: a third block filled
        step(core)
    core.abort("A", Finish.ERROR, "boom")
    step(core)
    check_invariants(core)
    assert len(core.workers[0].kv.pool.cached) == 2  # the prompt's blocks, cached by its chunk


def test_a_preempted_request_keeps_the_blocks_its_decodes_filled_cached() -> None:
    """B (the newest) is preempted when A's decodes run the pool out: the full blocks B's own
    decodes wrote stay cached under B's keys (evictable, for its readmission)."""
    core = core_of(blocks=9, token_budget=64)
    core.add(req("A", PROMPT[:4], 24))
    step(core)
    b = req("B", PROMPT[4:8], 24)
    core.add(b)
    pool = core.workers[0].kv.pool
    for _ in range(60):
        table, computed = list(pool.table("B")), b.num_computed
        step(core)
        check_invariants(core)
        if b.preemptions:
            break
    else:
        raise AssertionError("B was never preempted")
    full = computed // BS
    assert full == len(table) == 4  # one block of prompt, three its decodes filled
    keys = block_keys(b.tokens, BS, [], full)
    assert [pool.cached.get(key) for key in keys] == table


def test_keys_follow_the_block_size_of_the_pool_they_are_used_in() -> None:
    """w0 (blocks of 4) caches B's prompt. A and then C start like B, so placing them reads
    their keys for blocks of 4 there, but they run on w1 (blocks of 2, far more free): there
    they must use keys for blocks of 2, so that C, which shares only A's first 8 tokens, finds
    A's first 4 blocks; and A, moved back to w0 when w1 fails, finds B's blocks again."""
    specs = [WorkerSpec("w0", 16, 4, 4096), WorkerSpec("w1", 200, 2, 4096)]
    core = Recording(CoreConfig(token_budget=64), specs)
    core.drain_worker(1)
    core.add(req("B", PROMPT[:16] + [1], 1))
    run(core)
    core.restore_worker(1)
    core.add(req("A", PROMPT[:16] + [2], 4))
    step(core)
    assert core.seqs["A"].worker == 1
    core.add(req("C", PROMPT[:8] + list(range(500, 509)), 1))
    _, work = first_chunk(core, "C")
    assert core.seqs["C"].worker == 1 and work.start == 8
    core.fail_worker(1)
    _, work = first_chunk(core, "A")
    assert core.seqs["A"].worker == 0 and work.start == 16


def test_evictions_are_counted_across_the_pools_a_worker_had() -> None:
    core = core_of()
    ws = core.workers[0]
    for evictions in (3, 2):
        ws.kv.pool.evictions = evictions
        core.fail_worker(0)
        core.restore_worker(0)
    ws.kv.pool.evictions = 1
    assert core.snapshot().workers[0].evictions == 6


@pytest.mark.parametrize("how", ["cancel", "preempt"])
def test_a_chunk_that_fails_after_its_request_left_leaves_nothing_cached(how) -> None:
    """With overlap the failure of a step is learned after the next step was planned: its
    request may have been cancelled (and reaped) or preempted since, under another handle. The
    blocks cached from its failed chunk still leave the cache."""
    core = core_of(token_budget=8)
    core.add(req("A", PROMPT, 5))
    first = core.schedule(0)  # A's positions 0..7: blocks 0 and 1 cached
    if how == "cancel":
        core.abort("A")
    else:
        core._preempt(core.workers[0], core.seqs["A"])
    core.schedule(0)  # a cancelled A is reaped; a preempted A is placed again
    assert core.workers[0].kv.pool.cached
    core.fail_items(first, {first.chunks[0].handle: "boom"}, "w")
    check_invariants(core)
    assert core.workers[0].kv.pool.match(block_keys(PROMPT, BS, [], 2)) == []
