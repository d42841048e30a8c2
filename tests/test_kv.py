"""One worker's KV manager, asked directly as the core asks it: in terms of requests."""

from __future__ import annotations

from scheduler_svc.blocks import block_keys
from scheduler_svc.kv import FailedWork, KvManager
from scheduler_svc.kv_records import KvRecords
from scheduler_svc.reasons import StallReason
from scheduler_svc.sequence import Sequence

BS = 4


def req(rid: str, prompt: list[int], computed: int = 0) -> Sequence:
    seq = Sequence(rid, list(prompt), 4)
    seq.num_computed = computed
    return seq


def written(kv: KvManager, seq: Sequence, positions: int) -> None:
    """`seq` holds and has written `positions` positions, its full blocks committed."""
    assert kv.allocate(seq, positions) is not None
    kv.commit(seq, seq.num_computed, positions)
    seq.num_computed = positions


def test_allocate_answers_the_new_blocks_then_none_once_the_pool_is_full() -> None:
    kv = KvManager(4, BS, caching=False)
    a, b = req("a", [1] * 8), req("b", [2] * 8)
    assert kv.allocate(a, 6) == [0, 1] and kv.held(a) == 8
    assert kv.allocate(a, 8) == [] and kv.held(a) == 8  # it holds them already
    assert kv.allocate(b, 9) is None and kv.held(b) == 0  # three blocks, two free
    assert kv.allocate(b, 8) == [2, 3] and kv.num_free == 0
    assert kv.allocate(a, 9) is None


def test_a_request_finds_the_full_blocks_another_committed_but_not_its_last_token() -> None:
    kv = KvManager(16, BS, caching=True)
    prompt = list(range(10, 22))  # three full blocks
    a = req("a", prompt)
    written(kv, a, 12)
    assert kv.hit(req("b", prompt)) == []  # cached by the step being planned: not yet
    kv.sent()
    assert kv.hit(req("c", prompt)) == kv.pool.table("a")[:2]  # the third holds its last token
    assert kv.hit(req("d", prompt + [5])) == kv.pool.table("a")
    assert kv.hit(req("e", [9] + prompt)) == []
    assert KvManager(16, BS, caching=False).hit(req("f", prompt + [5])) == []


def test_free_keeps_the_cache_of_what_it_wrote_or_drops_it() -> None:
    for keep in (True, False):
        kv = KvManager(8, BS, caching=True)
        a = req("a", list(range(8)))
        a.output_ids = [50, 51, 52, 53]  # decoded: its third block is full, uncached
        assert kv.allocate(a, 12) is not None
        kv.commit(a, 0, 8)  # the prompt's chunk
        a.num_computed = 12
        kv.free(a, keep_cache=keep)
        assert len(kv.pool.cached) == (3 if keep else 2) and kv.num_free == 8
        assert kv.pool.tables == {}


def test_a_suspect_request_commits_nothing() -> None:
    kv = KvManager(8, BS, caching=True)
    a = req("a", list(range(8)))
    kv.mark_suspect(a)
    written(kv, a, 8)
    assert kv.pool.cached == {} and kv.records.of(a).cached_to == 0


def test_admission_counts_the_hit_the_evictable_and_what_the_running_reserved() -> None:
    kv = KvManager(6, BS, caching=True)
    prompt = list(range(30, 42))
    a = req("a", prompt)
    written(kv, a, 12)
    kv.sent()
    kv.free(a)  # three cached blocks, nobody holds them: counted free
    hit = kv.hit(req("b", prompt + [1]))
    assert len(hit) == 3 and kv.num_free == 6
    # 4 blocks for 13 positions, 3 of them the hit (taken from the free count): 4 of 6
    assert kv.why_not_admit(hit, 13, None, []) is None
    assert kv.why_not_admit([], 28, None, []) == StallReason.KV_CAPACITY  # 7 blocks of 6
    # reserving 7 blocks: what it writes now would fit, its reservation does not
    assert kv.why_not_admit([], 4, 28, []) == StallReason.KV_RESERVED
    assert kv.why_not_admit([], 4, 24, []) is None
    r = req("r", [7] * 4)
    assert kv.allocate(r, 20) is not None  # reserved 5 blocks, written none
    assert kv.reserved_unused([r]) == 5
    assert kv.why_not_admit([], 8, None, [r]) == StallReason.KV_RESERVED
    assert kv.why_not_admit([], 4, None, [r]) is None


def test_usage_counts_a_shared_block_once_and_each_requests_unwritten_tail() -> None:
    kv = KvManager(8, BS, caching=True)
    prompt = list(range(8))
    a = req("a", prompt + [9])
    written(kv, a, 9)
    kv.sent()
    b = req("b", prompt + [8])
    hit = kv.hit(b)
    kv.place(b, hit)
    b.num_computed = 8
    assert kv.allocate(b, 12) is not None  # one block more, nothing written in it
    usage = kv.usage([a, b])
    assert (usage.written, usage.unwritten, usage.free) == (9, 3 + 4, 4 * BS)
    assert (usage.cached_blocks, usage.evictable_blocks, usage.evictions) == (2, 0, 0)


def test_distrust_spreads_to_whoever_filled_a_block_over_a_distrusted_one() -> None:
    kv = KvManager(16, BS, caching=True)
    prompt = list(range(100, 108))
    a = req("a", prompt + [1])
    written(kv, a, 8)  # its two full blocks, committed by the failed chunk
    kv.sent()
    b = req("b", prompt + [2, 3, 4, 5, 6])  # admitted over a's blocks before the failure
    kv.place(b, kv.hit(b))
    b.num_computed = 8
    written(kv, b, 12)
    c = req("c", [7] * 8)  # unrelated
    written(kv, c, 8)
    failed = [FailedWork(a, 0, kv.pool.table("a"), owns_table=True)]
    assert kv.distrust(failed, [b, c]) == [b]
    assert kv.records.of(a).suspect and not kv.records.of(b).suspect  # the caller decides b's fate
    assert kv.pool.cached.keys() == set(block_keys(c.prompt_ids, BS, [], 2))
    assert KvManager(4, BS, caching=False).distrust(failed, [b]) == []


def test_a_new_prompt_takes_the_equal_leading_keys_of_the_latest_with_its_first_block() -> None:
    memo = KvRecords(size=1)
    document = list(range(200, 200 + 8 * BS))
    a = req("a", document + [1] * BS)
    memo.reuse(a, BS, 8)
    assert len(memo.of(a).keys) == 1  # nothing to reuse yet: its first key only
    memo.of(a).keys = block_keys(a.prompt_ids, BS, [], 9)
    b = req("b", document[: 5 * BS] + [2] * (4 * BS))
    memo.reuse(b, BS, 8)
    assert memo.of(b).keys == memo.of(a).keys[:5]  # five equal blocks, none hashed but the first
    other = req("c", [3] * (9 * BS))
    memo.reuse(other, BS, 8)  # pushes the others out of a memo of one
    d = req("d", list(document))
    memo.reuse(d, BS, 7)
    assert len(memo.of(d).keys) == 1
