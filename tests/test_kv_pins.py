"""One worker's KV manager, asked as the core asks it, in the cases the core's runs do not reach:
salted requests, keys reused or looked up again, a short prompt that decodes past a block,
reservations beside running requests, trims, caching switched, and a distrust that has to
follow keys or go round the running requests more than once."""

from __future__ import annotations

from scheduler_svc.blocks import block_keys
from scheduler_svc.kv import FailedWork, KvManager
from scheduler_svc.kv_records import KEY_MEMO, KvRecords
from scheduler_svc.reasons import StallReason
from scheduler_svc.sequence import Sequence

BS = 4


def req(
    rid: str, prompt: list[int], salt: bytes = b"", output: list[int] | None = None
) -> Sequence:
    return Sequence(rid, list(prompt), 4, cache_salt=salt, output_ids=list(output or []))


def written(kv: KvManager, seq: Sequence, positions: int) -> None:
    """`seq` holds and has written `positions` positions, its full blocks committed."""
    assert kv.allocate(seq, positions) is not None
    kv.commit(seq, seq.num_computed, positions)
    seq.num_computed = positions


def test_only_requests_of_equal_salt_find_each_others_blocks() -> None:
    kv = KvManager(16, BS, caching=True)
    prompt = list(range(10, 18))  # two full blocks
    written(kv, req("a", prompt + [1], b"tenant-1"), 8)
    kv.sent()
    assert kv.hit(req("b", prompt + [2], b"tenant-2")) == []
    assert kv.hit(req("c", prompt + [3])) == []
    assert kv.hit(req("d", prompt + [4], b"tenant-1")) == kv.pool.table("a")[:2]


def test_a_short_prompt_decoded_past_two_blocks_is_found_by_its_resent_conversation() -> None:
    """Its keys come from prompt and output together (the prompt is shorter than a block),
    salted like the prompt's: a request that resends the conversation finds both blocks."""
    kv = KvManager(16, BS, caching=True)
    a = req("a", [5, 6, 7], b"tenant-1")
    assert kv.hit(a) == []  # at its admission: nothing to look up, no key made
    assert kv.allocate(a, 9) is not None
    a.output_ids = [8, 9, 10, 11, 12, 13]
    a.num_computed = 9
    kv.free(a)  # its decodes filled two blocks: cached as it leaves
    kv.sent()
    conversation = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert len(kv.hit(req("b", conversation, b"tenant-1"))) == 2
    assert kv.hit(req("c", conversation)) == []


def test_a_recompute_with_output_reuses_only_the_keys_of_its_prompts_full_blocks() -> None:
    memo = KvRecords()
    document = list(range(300, 300 + 10 * BS))
    a = req("a", document + [1])
    memo.reuse(a, BS, 10)  # the first to start so: its first key only
    theirs = block_keys(a.prompt_ids, BS, memo.of(a).keys, 10)
    b = req("b", document[: 5 * BS + 2], output=list(range(900, 910)))  # 22 + 10 known
    memo.reuse(b, BS, (b.num_planned - 1) // BS)
    assert memo.of(b).keys == theirs[:5]


def test_requests_looked_up_again_after_others_with_their_first_block_keep_their_own_keys() -> None:
    """B and C wait (looked up at every plan), each with the first blocks of A's document and
    then tokens of its own; they are looked up in turn. Each keeps its own keys: their blocks
    are cached under their true keys, and a later request finds C's second block, not another."""
    kv = KvManager(64, BS, caching=True)
    document = list(range(500, 500 + 8 * BS))
    a = req("a", document + [1])
    kv.hit(a)
    written(kv, a, 8 * BS)
    kv.sent()
    b = req("b", document[: 2 * BS] + [7] * (6 * BS) + [2])
    c = req("c", document[: 2 * BS] + [8] * (6 * BS) + [3])
    for _ in range(2):
        assert kv.hit(b) == kv.hit(c) == kv.pool.table("a")[:2]
    for waiting in (b, c):
        waiting.output_ids = [4, 5, 6]  # decoded to 36 positions: nine full blocks
        written(kv, waiting, 9 * BS)
    kv.sent()
    e = req("e", document[: 2 * BS] + [9] * BS + [1])
    assert kv.hit(e) == kv.pool.table("c")[:2]


def test_a_reservation_fits_exactly_beside_a_request_reserved_whole() -> None:
    kv = KvManager(8, BS, caching=False)
    r = req("r", [1] * 4)
    r.max_planned = 16
    assert kv.allocate(r, 16) is not None  # its whole reservation: it owes nothing
    assert kv.owed([r]) == 0
    assert kv.why_not_admit([], 4, 16, [r]) is None  # the 4 blocks left
    assert kv.why_not_admit([], 4, 17, [r]) == StallReason.KV_RESERVED


def test_a_reservation_waits_for_the_blocks_a_paged_request_may_still_take() -> None:
    kv = KvManager(8, BS, caching=False)
    p = req("p", [1] * 4)
    p.max_planned = 16
    assert kv.allocate(p, 4) is not None  # admitted paged: 1 block of the 4 it may reach
    assert kv.owed([p]) == 3
    assert kv.why_not_admit([], 4, 16, [p]) is None  # 4 + 3 of the 7 free
    assert kv.why_not_admit([], 4, 20, [p]) == StallReason.KV_RESERVED  # 5 + 3


def test_freeing_keeps_the_cache_unless_told_otherwise() -> None:
    kv = KvManager(8, BS, caching=True)
    a = req("a", list(range(8)), output=[50, 51, 52, 53])  # decoded: its third block is full
    assert kv.allocate(a, 12) is not None
    kv.commit(a, 0, 8)
    a.num_computed = 12
    kv.free(a)
    assert kv.usage([]).cached_blocks == 3


def test_a_trim_leaves_the_request_holding_exactly_the_blocks_it_keeps() -> None:
    kv = KvManager(8, BS, caching=False)
    r = req("r", [1] * 4)
    assert kv.allocate(r, 16) is not None
    r.num_computed = 5
    assert kv.trim(r) == 2 and kv.held(r) == 2 * BS and kv.num_free == 6
    assert kv.allocate(r, 8) == [] and kv.trim(r) is None


def test_caching_turned_on_caches_and_left_on_keeps_what_is_cached() -> None:
    kv = KvManager(16, BS, caching=False)
    kv.set_caching(True)
    prompt = list(range(40, 48))
    written(kv, req("a", prompt + [1]), 8)
    kv.sent()
    kv.set_caching(True)  # another setting changed: caching stays on
    assert kv.hit(req("b", prompt + [2])) == kv.pool.table("a")[:2]


def test_a_chunk_failing_after_its_request_left_distrusts_its_later_chunks_by_their_keys() -> None:
    """A's second chunk, planned over its first, is cached; A is preempted (its table gone);
    then the first chunk fails. The second chunk's block leaves the cache too: once someone
    computes the first block again, nobody may find A's second one behind it."""
    kv = KvManager(16, BS, caching=True)
    prompt = list(range(60, 72))
    a = req("a", prompt + [1])
    assert kv.allocate(a, 8) is not None
    kv.commit(a, 0, 4)
    kv.commit(a, 4, 8)
    a.num_computed = 8
    first = kv.blocks(a, 0, 4)
    kv.free(a)
    kv.sent()
    kv.distrust([FailedWork(a, 0, first, owns_table=False)], [])
    b = req("b", prompt[:4] + [9])
    written(kv, b, 4)
    kv.sent()
    assert kv.hit(req("c", prompt + [1])) == kv.pool.table("b")[:1]


def test_distrust_reaches_a_request_through_one_looked_at_after_it() -> None:
    """The closure does not depend on the order the others are looked at: P holds only a
    block that Q, looked at after P, holds after a distrusted one."""
    kv = KvManager(32, BS, caching=True)
    f = req("f", [1] * 4 + [0])
    written(kv, f, 4)
    x = req("x", [2] * 4 + [0])
    written(kv, x, 4)
    kv.sent()
    [f0], [x0] = kv.pool.table("f"), kv.pool.table("x")
    t, p, q = req("t", [3] * 5), req("p", [4] * 5), req("q", [5] * 9)
    kv.place(t, [f0])
    kv.place(p, [x0])
    kv.place(q, [f0, x0])
    assert kv.distrust([FailedWork(f, 0, [f0], owns_table=True)], [t, p, q]) == [q, p, t]


def test_a_hit_like_the_latest_one_follows_what_the_cache_holds_now() -> None:
    """The latest hit of a first key is checked before the keys are looked up one by one: a
    block that left the cache since, or whose contents were computed anew in another block,
    is found as a lookup finds it."""
    kv = KvManager(16, BS, caching=True)
    prompt = list(range(80, 92))  # three full blocks
    a = req("a", prompt + [1])
    written(kv, a, 12)
    kv.sent()
    assert kv.hit(req("b", prompt[:8] + [2])) == kv.pool.table("a")[:2]
    assert kv.hit(req("c", prompt + [3])) == kv.pool.table("a")[:3]
    kv.distrust([FailedWork(a, 8, kv.blocks(a, 8, 12), owns_table=True)], [])
    assert kv.hit(req("d", prompt + [4])) == kv.pool.table("a")[:2]
    e = req("e", prompt + [5])
    kv.place(e, kv.hit(e))
    e.num_computed = 8
    written(kv, e, 12)
    kv.sent()
    assert kv.hit(req("f", prompt + [6])) == kv.pool.table("a")[:2] + kv.pool.table("e")[2:3]


def test_prompts_of_their_own_push_out_of_the_memo_only_each_other() -> None:
    """A document's first key, seen again, stays in the memo through more prompts of their own
    than it holds: the next request of the document takes its keys."""
    memo = KvRecords(size=3)
    document = list(range(700, 700 + 4 * BS))
    a = req("a", document + [1])
    memo.reuse(a, BS, 4)
    memo.of(a).keys = block_keys(a.prompt_ids, BS, [], 4)
    b = req("b", document + [2])
    memo.reuse(b, BS, 4)
    assert memo.of(b).keys == memo.of(a).keys
    for i in range(5):
        memo.reuse(req(f"own{i}", [i] * (4 * BS)), BS, 4)
    c = req("c", document + [3])
    memo.reuse(c, BS, 4)
    assert memo.of(c).keys == memo.of(a).keys


def test_keys_taken_from_the_memo_are_the_keys_hashing_gives() -> None:
    """Prompts sharing a first block and then more or fewer of a document's blocks, in an
    order that makes the memo's head longer, shorter and wrong: every prompt takes exactly the
    keys of the blocks it shares with the one before, and they are its own tokens' keys."""
    document = list(range(900, 900 + 12 * BS))
    memo = KvRecords(size=2)
    before = 0
    for i, shared in enumerate([12, 12, 8, 8, 12, 3, 1, 12, 10, 10, 2, 12]):
        prompt = document[: shared * BS] + [i] * (2 * BS) + [7]
        seq = req(str(i), prompt)
        memo.reuse(seq, BS, len(prompt) // BS)
        taken = memo.of(seq).keys
        assert len(taken) == max(1, min(shared, before)), i
        assert taken == block_keys(prompt, BS, [], len(taken)), i
        memo.keys_of(seq, len(prompt) // BS, BS)  # its chunks hash the rest
        before = shared


def test_a_memo_following_live_requests_finds_one_it_pushed_out_while_it_lives() -> None:
    memo = KvRecords(size=1, live=True)
    document = list(range(1100, 1100 + 4 * BS))
    a = req("a", document + [1])
    memo.reuse(a, BS, 4)
    memo.keys_of(a, 4, BS)
    memo.reuse(req("own", [3] * (4 * BS)), BS, 4)  # pushes a out of a memo of one
    b = req("b", document + [2])
    memo.reuse(b, BS, 4)
    assert memo.of(b).keys == memo.of(a).keys  # a lives: its keys are taken
    del a, b
    memo.reuse(req("own2", [4] * (4 * BS)), BS, 4)
    c = req("c", document + [5])
    memo.reuse(c, BS, 4)
    assert len(memo.of(c).keys) == 1  # both gone: nothing to take


def test_a_memo_head_is_always_a_prefix_of_its_own_prompt() -> None:
    """After a prompt that differs from the memo's head within it, the head kept is that
    prompt's own first blocks, not the head it replaced: a later prompt equal to the old head
    takes none of the differing prompt's keys for its own blocks."""
    memo = KvRecords(size=4)
    a, b, c, x, y, z, w, e = ([n] * BS for n in range(10, 18))
    for rid, blocks in (("r1", [a, b, c, w]), ("r2", [a, b, c, e]), ("r3", [a, x, y, z])):
        seq = req(rid, sum(blocks, []) + [1])
        memo.reuse(seq, BS, 4)
        memo.keys_of(seq, 4, BS)  # its chunks hash the rest
    r4 = req("r4", a + b + c + z + [1])
    memo.reuse(r4, BS, 4)
    taken = memo.of(r4).keys
    assert taken == block_keys(r4.prompt_ids, BS, [], len(taken))


def test_a_memo_of_two_keeps_a_first_key_seen_again_through_prompts_of_their_own() -> None:
    memo = KvRecords(size=2)
    document = list(range(700, 700 + 4 * BS))
    a = req("a", document + [1])
    memo.reuse(a, BS, 4)
    memo.keys_of(a, 4, BS)
    memo.reuse(req("b", document + [2]), BS, 4)  # seen again
    for i in range(3):
        memo.reuse(req(f"own{i}", [i] * (4 * BS)), BS, 4)
    c = req("c", document + [3])
    memo.reuse(c, BS, 4)
    assert memo.of(c).keys == memo.of(a).keys


def test_hits_of_more_first_keys_than_the_memo_holds_are_all_found() -> None:
    """The latest hit of each first key is remembered for at most KEY_MEMO first keys: the
    oldest goes, and every lookup still finds what the cache holds."""
    kv = KvManager(4 * (KEY_MEMO + 8), BS, caching=True)
    prompts = [[1000 + i] * (2 * BS) for i in range(KEY_MEMO + 4)]
    for i, prompt in enumerate(prompts):
        written(kv, req(f"w{i}", prompt + [1]), 2 * BS)
    kv.sent()
    for i, prompt in enumerate(prompts):
        assert kv.hit(req(f"r{i}", prompt + [2])) == kv.pool.table(f"w{i}")
    assert len(kv.recent) == KEY_MEMO
