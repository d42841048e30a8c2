"""The prefix cache in the core: requests that start alike share full KV blocks by reference,
admission counts a hit honestly, cached blocks nobody holds are evicted least recently used
first, and every block's reference count is the number of tables that list it."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.blocks import BlockPool, block_keys
from scheduler_svc.config import CoreConfig, KvPolicy, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.reasons import StallReason
from scheduler_svc.sequence import Finish, Sequence
from tests.sim import Overlapped, Recording, check_invariants, fake_token, step

BS = 4


def core_of(blocks: int = 64, caching: bool = True, **cfg) -> Scheduler:
    config = CoreConfig(prefix_caching=caching, **cfg)
    return Recording(config, [WorkerSpec("w", blocks, BS, 4096)])


def req(rid: str, prompt: list[int], max_tokens: int = 3) -> Sequence:
    return Sequence(rid, list(prompt), max_tokens)


def run(core: Scheduler, limit: int = 500) -> dict[str, list[int]]:
    """Steps until nothing waits or runs; the outputs of the requests that finished."""
    out: dict[str, list[int]] = {}
    for _ in range(limit):
        for e in core.take_events():
            if e.token_id is not None:
                out.setdefault(e.request_id, []).append(e.token_id)
        if not core.waiting and not any(ws.running for ws in core.workers):
            return out
        step(core)
        check_invariants(core)
    raise AssertionError("did not finish")


def first_chunk(core: Scheduler, rid: str):
    """Plan one step; the chunk of `rid` in it."""
    [planned] = core.schedule_all()
    check_invariants(core)
    [work] = [w for w in planned.chunks if w.seq.request_id == rid]
    return planned, work


PROMPT = list(range(10, 30))  # 20 tokens: 5 full blocks


def test_a_request_that_starts_like_a_finished_one_computes_only_the_rest() -> None:
    core = core_of()
    core.add(req("A", PROMPT))
    run(core)
    core.add(req("B", PROMPT[:16] + [7, 8, 9]))  # 4 blocks alike, then 3 tokens of its own
    planned, work = first_chunk(core, "B")
    assert (work.start, work.num_tokens) == (16, 3)
    assert planned.num_tokens == 3  # the token budget is charged 3, not 19
    [(handle, shared)] = planned.shares
    assert handle == work.handle and len(shared) == 4
    assert core.workers[0].kv.pool.table("B")[:4] == shared
    kv = core.snapshot().workers[0]
    assert (kv.prompt_tokens, kv.hit_tokens) == (20 + 19, 16)


def test_a_prompt_wholly_cached_still_computes_its_last_token() -> None:
    """The logits of the last prompt token sample the first output: at least one token runs."""
    core = core_of()
    core.add(req("A", PROMPT))
    run(core)
    core.add(req("B", PROMPT))
    _, work = first_chunk(core, "B")
    assert (work.start, work.num_tokens) == (16, 4)  # 20 tokens: 4 whole blocks from the cache


def test_outputs_are_the_same_with_the_cache_on_and_off() -> None:
    """Shared system prompts, resent histories, a tight pool with preemptions and evictions."""
    rng = random.Random(5)
    systems = [[rng.randrange(3, 900) for _ in range(rng.randrange(6, 14))] for _ in range(3)]
    requests = []
    for i in range(40):
        history = rng.choice(systems) + [rng.randrange(3, 900) for _ in range(rng.randrange(1, 9))]
        if requests and rng.random() < 0.5:
            history = requests[rng.randrange(len(requests))][1] + history[-3:]
        requests.append((f"r{i}", history[:60], rng.randrange(1, 8)))
    outs = []
    for caching in (False, True):
        core = core_of(blocks=30, caching=caching, token_budget=16, max_running=6)
        for rid, prompt, n in requests:
            core.add(req(rid, prompt, n))
        outs.append(run(core, limit=3000))
        kv = core.snapshot().workers[0]
        assert (kv.hit_tokens > 0) is caching
    assert outs[0] == outs[1]
    assert len(outs[0]) == len(requests)


def test_every_output_is_what_the_model_gives_its_whole_context() -> None:
    """With the cache, a request's tokens still follow from its whole prompt (fake model)."""
    core = core_of()
    core.add(req("A", PROMPT, 1))
    run(core)
    b = req("B", PROMPT + [5], 3)
    core.add(b)
    out = run(core)["B"]
    context = b.prompt_ids
    for token in out:
        assert token == fake_token(context)
        context = context + [token]


def test_blocks_shared_by_running_requests_are_never_evicted_or_reused() -> None:
    """A and B run sharing 4 blocks; C needs more than the rest of the pool: it waits on KV
    rather than take a shared block, and nobody writes into one."""
    core = core_of(blocks=12, token_budget=64)
    core.add(req("A", PROMPT, 8))
    step(core)
    core.add(req("B", PROMPT[:16] + [1, 2], 8))
    step(core)
    pool = core.workers[0].kv.pool
    shared = pool.table("B")[:4]
    keys = {pool.key_of[b] for b in shared}
    assert shared == pool.table("A")[:4] and all(pool.refs[b] == 2 for b in shared)
    core.add(req("C", list(range(500, 532)), 2))  # 8 blocks now: more than the 6 not held
    for _ in range(5):
        step(core)
        check_invariants(core)
        assert pool.table("A")[:4] == shared == pool.table("B")[:4]
        assert {pool.key_of.get(b) for b in shared} == keys  # still cached: never evicted
        assert "C" not in pool.tables and core.head_reason is StallReason.KV_CAPACITY
    out = run(core)
    assert len(out["C"]) == 2 and len(out["A"]) == 8 and len(out["B"]) == 8


def test_eviction_under_pressure_takes_the_least_recently_used_cached_block_first() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    keys = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 2, [], 4)
    for rid, positions in (("old", 2), ("mid", 2), ("new", 2)):
        pool.grow(rid, positions)
    for rid, key in zip(("old", "mid", "new"), keys, strict=False):
        pool.cache(pool.table(rid)[0], key)
    pool.fresh.clear()  # their step has been sent
    blocks = {rid: pool.table(rid)[0] for rid in ("old", "mid", "new")}
    for rid in ("old", "mid", "new"):  # released in this order: "old" is used least recently
        pool.release(rid)
    pool.share("again", [blocks["old"]])  # a hit makes "old" the most recently used
    pool.release("again")
    assert pool.num_free == 4 and list(pool.evictable) == [
        blocks["mid"],
        blocks["new"],
        blocks["old"],
    ]
    taken = pool.grow("x", 6)  # the free block first, then "mid", then "new"
    assert taken[0] not in blocks.values() and taken[1:] == [blocks["mid"], blocks["new"]]
    assert pool.evictions == 2 and pool.match(keys[:1]) == [blocks["old"]]
    assert pool.match(keys[1:2]) == []


def test_a_released_sequence_is_evicted_from_its_end_first() -> None:
    pool = BlockPool(num_blocks=3, block_size=1)
    pool.grow("a", 3)
    keys = block_keys([7, 8, 9], 1, [], 3)
    for block, key in zip(pool.table("a"), keys, strict=True):
        pool.cache(block, key)
    pool.fresh.clear()
    first, second, third = pool.table("a")
    pool.release("a")
    assert pool.grow("b", 1) == [third]
    assert pool.match(keys) == [first, second]


def test_cancelling_a_request_that_shares_blocks_frees_only_its_own_references() -> None:
    core = core_of(token_budget=64)
    core.add(req("A", PROMPT, 30))
    step(core)
    core.add(req("B", PROMPT[:16] + [1, 2], 30))
    step(core)
    pool = core.workers[0].kv.pool
    shared, own = pool.table("B")[:4], pool.table("B")[4:]
    core.abort("B")
    step(core)
    check_invariants(core)
    assert pool.table("A")[:4] == shared and all(pool.refs[b] == 1 for b in shared)
    assert "B" not in pool.tables and all(pool.refs[b] == 0 for b in own)


def test_a_preempted_request_that_shares_blocks_frees_only_its_own_and_finds_them_again() -> None:
    core = core_of(blocks=13, token_budget=64, max_running=4)
    core.add(req("A", PROMPT, 24))  # grows to 44 positions: 11 blocks
    step(core)
    core.add(req("B", PROMPT[:16] + [1, 2, 3], 24))  # with A, more than the pool
    step(core)
    pool = core.workers[0].kv.pool
    shared = pool.table("A")[:4]
    for _ in range(40):
        step(core)
        check_invariants(core)
        b = core.seqs.get("B")
        if b is not None and b.preemptions:
            break
    else:
        raise AssertionError("B was never preempted")
    assert pool.table("A")[:4] == shared and all(pool.refs[x] == 1 for x in shared)
    out = run(core, limit=400)
    assert len(out["A"]) == 24
    kv = core.snapshot().workers[0]
    assert kv.hit_tokens >= 16 + 16  # B's first admission and its readmission both hit


def test_evictable_cached_blocks_count_as_free_for_admission() -> None:
    """The seed's pool of 24 positions: A's 20-token prompt and output finish and stay cached,
    yet a new 20-token request is admitted at once: evictable blocks are free."""
    core = Recording(CoreConfig(token_budget=32), [WorkerSpec("w", 6, BS, 4096)])
    core.add(req("A", PROMPT, 2))
    run(core)
    kv = core.snapshot().workers[0]
    assert kv.cached_blocks == 5 and kv.evictable_blocks == 5 and kv.free == 24
    core.add(req("C", list(range(300, 320)), 2))
    planned, work = first_chunk(core, "C")
    assert work.num_tokens == 20 and core.head_reason is None
    assert core.snapshot().workers[0].evictions == 4  # A's 6th block was free, not cached


def test_a_hit_shrinks_the_blocks_a_request_needs_so_it_is_admitted_where_it_would_stall() -> None:
    """KV capacity 24 positions (6 blocks of 4). B runs holding 4 shared blocks + its own; C
    starts like B: without the cache it needs 5 blocks and stalls on KV capacity; with it only
    the block past the shared prefix, and it runs."""
    reasons = {}
    for caching in (False, True):
        core = Recording(
            CoreConfig(token_budget=32, prefix_caching=caching), [WorkerSpec("w", 6, BS, 4096)]
        )
        core.add(req("B", PROMPT[:16] + [1], 6))
        step(core)
        core.add(req("C", PROMPT[:16] + [2, 3], 2))
        step(core)
        reasons[caching] = (
            core.head_reason,
            "C" in {s.request_id for s in core.workers[0].running},
        )
    assert reasons[False] == (StallReason.KV_CAPACITY, False)
    assert reasons[True] == (None, True)


def test_reserve_shares_nothing() -> None:
    core = core_of(policy=KvPolicy.RESERVE)
    core.add(req("A", PROMPT))
    run(core)
    core.add(req("B", PROMPT))
    planned, work = first_chunk(core, "B")
    assert work.start == 0 and not planned.shares
    assert core.snapshot().workers[0].cached_blocks == 0


def test_blocks_a_chunk_fills_are_readable_only_from_the_next_step() -> None:
    """A's prompt and B (the same prompt) arrive together: B may not read blocks A's step is
    writing; in a later step it may."""
    core = core_of(token_budget=64)
    core.add(req("A", PROMPT, 5))
    core.add(req("B", PROMPT[:16] + [1], 5))
    [planned] = core.schedule_all()
    assert not planned.shares and [w.start for w in planned.chunks] == [0, 0]
    core.complete(planned, [fake_token(w.seq.tokens) for w in planned.chunks])
    core.add(req("C", PROMPT[:16] + [2], 5))
    planned, work = first_chunk(core, "C")
    assert work.start == 16


def test_a_failed_chunk_is_not_cached_and_a_request_that_read_it_starts_over() -> None:
    """With overlap, C is admitted onto A's blocks before A's step is known to have failed:
    the blocks leave the cache and C is recomputed from its start."""
    core = core_of(token_budget=64)
    core.add(req("A", PROMPT, 5))
    driver = Overlapped(core)
    first = core.schedule(0)
    core.add(req("C", PROMPT[:16] + [2], 5))
    second = core.schedule(0)
    assert [w.start for w in second.chunks if w.seq.request_id == "C"] == [16]
    core.fail_items(first, {first.chunks[0].handle: "boom"}, "w")
    check_invariants(core)
    assert [(e.request_id, e.finish) for e in core.take_events() if e.finish] == [
        ("A", Finish.ERROR)
    ]
    assert core.workers[0].kv.pool.cached == {}
    c = core.seqs["C"]
    assert c.preemptions == 1 and [s.request_id for s in core.waiting] == ["C"]
    core.complete(first, [])
    driver.inflight = second
    driver.flush()
    out = run(core)
    assert len(out["C"]) == 5 and "A" not in out


def test_placement_weighs_cached_positions_against_free_ones() -> None:
    """Two pools of 256 positions. w0 caches A's 80 tokens and runs X (44 positions held):
    B, which resends A's 80 tokens, goes to w0 (212 free + 80 cached > 256 free on w1); D,
    which shares only A's first block, goes to w1 (212 + 4 < 256)."""
    specs = [WorkerSpec("w0", 64, BS, 4096), WorkerSpec("w1", 64, BS, 4096)]
    core = Recording(CoreConfig(token_budget=256), specs)
    a = list(range(100, 180))
    core.add(req("A", a, 1))
    run(core)
    core.add(req("X", list(range(600, 640)), 50))
    step(core)
    assert core.seqs["X"].worker == 0
    core.add(req("B", a + [1], 1))
    step(core)
    assert core.seqs["B"].worker == 0 and core.snapshot().workers[0].hit_tokens == 80
    core.add(req("D", a[:4] + list(range(700, 720)), 1))
    step(core)
    assert core.seqs["D"].worker == 1 and core.snapshot().workers[1].hit_tokens == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_randomized_shared_prefixes_keep_every_invariant(overlap: bool) -> None:
    rng = random.Random(11)
    prefixes = [[rng.randrange(3, 900) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    core = Recording(
        CoreConfig(token_budget=rng.choice([8, 16, 32]), max_running=5),
        [WorkerSpec("w0", 20, BS, 64), WorkerSpec("w1", 14, 2, 64)],
    )
    drivers = [Overlapped(core, 0), Overlapped(core, 1)]
    added, finished = 0, 0
    for i in range(3000):
        if i < 200 and rng.random() < 0.4:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 900) for _ in range(rng.randrange(6))]
            core.add(req(f"r{i}", prompt[:40], rng.randrange(1, 12)))
            added += 1
        if rng.random() < 0.05 and core.seqs:
            core.abort(rng.choice(list(core.seqs)))
        if overlap:
            for d in drivers:
                d.step()
        else:
            step(core)
        check_invariants(core)
        finished += sum(1 for e in core.take_events() if e.finish)
        if i > 200 and finished == added:
            break
    assert finished == added > 50
    assert sum(kv.hit_tokens for kv in core.snapshot().workers) > 0
