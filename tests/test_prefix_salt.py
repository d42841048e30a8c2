"""Prefix-cache isolation (cache_salt) in the core: requests share cached KV blocks only when
their salts are equal; the salt seeds the key chain, so chains of different salts (or a salted
and an unsalted one) never share a key; the default (no salt) shares as before."""

from __future__ import annotations

from scheduler_svc.blocks import block_keys
from scheduler_svc.sequence import Sequence
from tests.test_prefix_core import BS, PROMPT, core_of, first_chunk, run


def salted(rid: str, salt: bytes) -> Sequence:
    return Sequence(rid, list(PROMPT), 3, cache_salt=salt)


def hit_of_second(first: bytes, second: bytes) -> int:
    """Positions the second request (same prompt as the first, which has finished) starts
    after: what the cache served it."""
    core = core_of()
    core.add(salted("A", first))
    run(core)
    core.add(salted("B", second))
    _, work = first_chunk(core, "B")
    assert core.snapshot().workers[0].hit_tokens == work.start
    return work.start


def test_the_same_salt_shares_the_cached_prefix() -> None:
    assert hit_of_second(b"tenant-1", b"tenant-1") == 16
    assert hit_of_second(b"", b"") == 16  # no salt: shared as before


def test_different_salts_share_nothing() -> None:
    assert hit_of_second(b"tenant-1", b"tenant-2") == 0
    assert hit_of_second(b"", b"tenant-2") == 0
    assert hit_of_second(b"tenant-1", b"") == 0


def test_salted_chains_share_no_key_with_each_other_or_the_unsalted_one() -> None:
    tokens = list(range(40))
    chains = [block_keys(tokens, BS, [], 10, salt) for salt in (b"", b"a", b"b")]
    assert len({key for chain in chains for key in chain}) == 30
    # a salt equal to a key of another chain still seeds a chain of its own
    other = block_keys(tokens[BS:], BS, [], 9, chains[0][0])
    assert set(other).isdisjoint(chains[0])


def test_a_salted_chain_extended_step_by_step_equals_one_computed_at_once() -> None:
    tokens = list(range(40))
    stepwise: list[bytes] = []
    for upto in (1, 4, 10):
        block_keys(tokens, BS, stepwise, upto, b"s")
    assert stepwise == block_keys(tokens, BS, [], 10, b"s")
