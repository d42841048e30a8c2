"""KV block accounting of one pool: blocks round up, grow appends what is missing, release
returns it; a request holding enough needs nothing more, even from a full pool."""

from __future__ import annotations

from scheduler_svc.blocks import BlockPool, blocks_for


def test_blocks_round_up_to_whole_blocks() -> None:
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_grow_appends_the_missing_blocks_in_pool_order_and_returns_them() -> None:
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.grow("a", 5) == [0, 1]
    assert pool.grow("b", 4) == [2]
    assert pool.grow("a", 8) == []  # 8 positions: the two blocks hold them
    assert pool.grow("a", 9) == [3]
    assert pool.table("a") == [0, 1, 3] and pool.allocated("a") == 3
    assert (pool.num_free, pool.table("nobody"), pool.allocated("nobody")) == (2, [], 0)


def test_what_is_missing_counts_only_blocks_not_held_yet() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    pool.grow("a", 12)  # the whole pool
    assert (pool.missing("a", 12), pool.missing("a", 3)) == (0, 0)
    assert pool.can_grow("a", 12) and not pool.can_grow("a", 13)
    assert pool.missing("b", 1) == 1 and not pool.can_grow("b", 1)
    assert pool.can_grow("b", 0)


def test_release_returns_a_requests_blocks_and_forgets_it() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.grow("a", 3)
    pool.grow("b", 2)
    pool.release("a")
    pool.release("a")  # again, or a request that never held any: nothing happens
    pool.release("never")
    assert pool.num_free == 3 and "a" not in pool.tables
    assert pool.grow("c", 6) == [3, 0, 1]  # the oldest free block first
