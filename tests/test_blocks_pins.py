"""The block pool's and the prefix keys' contracts that the core's runs do not reach: salts
kept apart from keys, keys extended from an offset, the equal leading blocks of two prompts,
the cached-block mapping's answers, evictions counted over time, and misuse refused."""

from __future__ import annotations

from array import array

import pytest

from scheduler_svc.blocks import BlockPool, block_keys, common_blocks

BS = 4


def test_a_salt_equal_to_a_blocks_tokens_starts_no_chain_that_block_does() -> None:
    """A salt is hashed apart from the blocks: a client whose salt is the packed ids of
    another's first block must not get that chain's keys for its own blocks."""
    first, second = [1, 2, 3, 4], [5, 6, 7, 8]
    plain = block_keys(first + second, BS, [], 2)
    salt = array("I", first).tobytes()
    salted = block_keys(second, BS, [], 1, salt)
    assert salted[0] not in plain
    # nor when the salt is a key itself: the salted chain does not continue that chain
    assert block_keys(second, BS, [], 1, plain[0])[0] != plain[1]


def test_different_salts_give_different_keys_and_equal_salts_equal_keys() -> None:
    tokens = list(range(3, 3 + 2 * BS))
    a = block_keys(tokens, BS, [], 2, b"tenant-a")
    assert a == block_keys(tokens, BS, [], 2, b"tenant-a")
    assert not set(a) & set(block_keys(tokens, BS, [], 2, b"tenant-b"))
    assert not set(a) & set(block_keys(tokens, BS, [], 2))


def test_keys_extended_from_an_offset_stop_at_the_blocks_asked_for() -> None:
    """Extending from position 8 with the tokens from there on: one key more, the key of the
    third block, although the tokens go on for two blocks and a half."""
    tokens = list(range(50, 50 + 5 * BS + 2))
    whole = block_keys(tokens, BS, [], 5)
    keys = whole[:2]
    block_keys(tokens[2 * BS :], BS, keys, 3, offset=2 * BS)
    assert keys == whole[:3]


def test_common_blocks_counts_the_equal_leading_full_blocks_up_to_the_limit() -> None:
    a = list(range(100))
    assert common_blocks(a, [-1] + a[1:], BS, 10) == 0  # the first block differs
    assert common_blocks(a, list(a), BS, 0) == 0
    assert common_blocks(a, a[:9] + [-1] + a[10:], BS, 20) == 2  # block 2 holds position 9
    assert common_blocks(a, list(a), BS, 7) == 7


def test_common_blocks_finds_a_difference_past_the_first_run_of_blocks() -> None:
    """Past the first 32 blocks the run doubles, then halves around the difference."""
    a = list(range(50 * BS))
    b = list(a)
    b[37 * BS + 1] = -1
    assert common_blocks(a, b, BS, 50) == 37
    assert common_blocks(a, list(a), BS, 50) == 50


def test_common_blocks_from_blocks_known_equal_counts_as_from_none() -> None:
    a = list(range(60 * BS))
    b = list(a)
    b[37 * BS + 1] = -1
    for start in (1, 2, 20, 36, 37):
        assert common_blocks(a, b, BS, 50, start) == 37
        assert common_blocks(a, list(a), BS, 50, start) == 50
        assert common_blocks(a, b, BS, 30, min(start, 30)) == 30


def test_the_cached_block_map_answers_only_for_cached_blocks_in_range() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    pool.grow("a", 4)
    [key0, key1] = block_keys([1, 2, 3, 4], 2, [], 2)
    pool.cache_all([0, 1], [key0, key1])
    assert pool.key_of[1] == key1 and 1 in pool.key_of
    for block in (-1, 2):
        assert block not in pool.key_of
        assert pool.key_of.get(block) is None
        with pytest.raises(KeyError) as raised:
            pool.key_of[block]
        assert raised.value.args == (block,)


def test_evictions_add_up_over_the_pools_life() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    keys = block_keys([1, 2, 3, 4], 2, [], 2)
    for round in (1, 2):
        pool.grow("a", 4)
        pool.cache_all(pool.table("a"), keys if round == 1 else block_keys([5, 6, 7, 8], 2, [], 2))
        pool.fresh.clear()
        pool.release("a")  # both cached, nobody holds them: evictable
        pool.grow("b", 4)  # takes both
        assert pool.evictions == 2 * round
        pool.release("b")


def test_shrinking_a_request_that_holds_nothing_drops_nothing() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    assert pool.shrink("nobody", 0) == 0 and pool.num_free == 2


def test_caching_refuses_blocks_and_keys_of_different_lengths() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    pool.grow("a", 4)
    with pytest.raises(ValueError, match="^2 blocks for 1 keys$"):
        pool.cache_all([0, 1], block_keys([1, 2], 2, [], 1))


def test_a_likely_hit_is_taken_only_where_each_block_is_readable_under_its_key() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.grow("a", 6)
    keys = block_keys([1, 2, 3, 4, 5, 6], 2, [], 3)
    pool.cache_all([0, 1, 2], keys)
    assert pool.match_as(keys, [0, 1, 2]) == []  # cached by the step being planned: not yet
    pool.fresh.clear()
    assert pool.match_as(keys, [0, 1, 2]) == [0, 1, 2] == pool.match(keys)
    assert pool.match_as(keys[:2], [0, 1, 2]) == [0, 1]  # as far as the keys go
    assert pool.match_as(keys, [0, 1]) == [0, 1]
    assert pool.match_as(keys, [0, 2]) == []  # block 2 holds another key
    assert pool.match_as(keys, []) == [] and pool.match_as([], [0]) == []
    pool.uncache([1])
    assert pool.match_as(keys, [0, 1, 2]) == [] and pool.match(keys) == [0]


def test_a_lookup_stops_at_the_first_key_missing_or_cached_in_the_step_being_planned() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.grow("a", 8)
    keys = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 2, [], 4)
    pool.cache_all([0, 1], keys[:2])
    pool.fresh.clear()
    pool.cache_all([3], keys[3:])
    assert pool.match(keys) == [0, 1]  # the third key is missing
    pool.cache_all([2], keys[2:3])
    assert pool.match(keys) == [0, 1]  # the third block is fresh
    pool.fresh.clear()
    assert pool.match(keys) == [0, 1, 2, 3] and pool.match([]) == []


def test_growing_takes_the_last_free_and_evictable_blocks_and_refuses_one_more() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.grow("a", 4)
    pool.cache_all(pool.table("a"), block_keys([1, 2, 3, 4], 2, [], 2))
    pool.release("a")  # two evictable, two free
    assert pool.try_grow("b", 10) is None and pool.table("b") == []
    assert pool.try_grow("b", 8) is not None and pool.num_free == 0
    assert pool.try_grow("b", 8) == [] and pool.try_grow("b", 9) is None


def test_a_chunk_whose_first_block_is_cached_caches_each_of_the_rest() -> None:
    """A table whose first block is cached already (shared, or its earlier chunk's) and whose
    next ones are not: the cached one stays as it is, the others are cached under their keys
    and are fresh until the step is sent; none stops the ones after it."""
    pool = BlockPool(8, BS)
    table = pool.grow("a", 4 * BS)
    keys = block_keys(list(range(20, 20 + 4 * BS)), BS, [], 4)
    pool.cache_all(table[:1], keys[:1])
    pool.fresh.clear()  # sent
    pool.cache_all(table, keys)
    assert pool.cached == dict(zip(keys, table, strict=True))
    assert [pool.key_of[b] for b in table] == keys
    assert pool.fresh == set(table[1:])


def test_a_chunk_caching_contents_cached_in_another_block_takes_the_key_from_it() -> None:
    """The newest computation of a key is the one the cache names: the other block, not held,
    is forgotten and plainly free."""
    pool = BlockPool(8, BS)
    keys = block_keys(list(range(20, 20 + 2 * BS)), BS, [], 2)
    [elsewhere] = pool.grow("old", BS)
    pool.cache_all([elsewhere], keys[1:])
    pool.release("old")  # cached, evictable
    table = pool.grow("a", 2 * BS)
    pool.cache_all(table[:1], keys[:1])
    free = pool.num_free
    pool.cache_all(table, keys)
    assert pool.cached == {keys[0]: table[0], keys[1]: table[1]}
    assert elsewhere not in pool.key_of and pool.num_free == free
    assert pool.match(keys) == []  # fresh: not readable before its step is sent
    pool.fresh.clear()
    assert pool.match(keys) == table
