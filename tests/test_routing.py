"""The router (gateway/routing/): which cell a request goes to, and why."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.routing import Reason, RoutePolicy, Router, RouterSettings, prompt_keys
from gateway.routing.prefix_index import PrefixIndex
from scheduler_svc.blocks import block_keys

BS = 16
CELLS = ["a", "b", "c", "d"]


def router(policy: RoutePolicy = RoutePolicy.CACHE_AWARE, **kw) -> Router:
    """Loads of the work in flight only, unless the test says otherwise."""
    kw.setdefault("recent_half_life_s", 0.0)
    return Router(CELLS, RouterSettings(policy=policy, **kw))


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n)]


def test_prompt_keys_are_the_scheduler_prefix_cache_keys_salted_alike():
    prompt = ids(1, 5 * BS + 3)
    assert prompt_keys(prompt, BS, b"t") == [hash(k) for k in block_keys(prompt, BS, [], 5, b"t")]
    assert prompt_keys(prompt, BS, b"t") != prompt_keys(prompt, BS, b"u")
    assert len(prompt_keys(prompt, BS, max_blocks=2)) == 2


def test_a_conversations_next_turn_goes_where_its_history_was_sent():
    r = router()
    history = ids(1, 40 * BS)
    first = r.route(prompt_keys(history, BS))
    r.done(first)
    for other in range(2, 8):  # other conversations in between, done at once
        r.done(r.route(prompt_keys(ids(other, 40 * BS), BS)))
    nxt = r.route(prompt_keys(history + ids(99, 2 * BS), BS))
    assert (nxt.cell, nxt.reason) == (first.cell, Reason.MATCH)
    assert nxt.matched_blocks == 40 and nxt.prompt_blocks == 42


def test_a_prompt_matching_nothing_goes_to_the_least_loaded_cell():
    r = router()
    held = [r.route(prompt_keys(ids(s, 4 * BS), BS)) for s in range(3)]  # three cells busy
    fresh = r.route(prompt_keys(ids(50, 4 * BS), BS))
    assert fresh.reason is Reason.LOAD
    assert fresh.cell not in {h.cell for h in held}


def test_unbalanced_loads_override_the_match():
    r = router(balance_abs_threshold=200, balance_rel_threshold=1.5, load_weight=0.1)
    keys = prompt_keys(ids(1, 8 * BS), BS)
    first = r.route(keys, 8 * BS, 40)  # 168 tokens of work: nothing cached
    second = r.route(keys, 8 * BS, 40)  # its prompt cached there: 40 more
    assert (second.cell, second.reason, second.weight) == (first.cell, Reason.MATCH, 40)
    third = r.route(keys, 8 * BS, 40)  # 208 in flight there, 0 elsewhere: unbalanced
    assert third.reason is Reason.LOAD and third.cell != first.cell


def test_a_cell_loaded_past_what_its_cache_saves_loses_to_an_idle_one():
    r = router()  # load_weight 1: a cell's load in tokens weighs what its cache saves
    keys = prompt_keys(ids(1, 8 * BS), BS)
    placed = r.route(keys, 8 * BS, 16)
    r.report_load(placed.cell, 400)  # busy with others' requests
    moved = r.route(keys, 8 * BS, 16)
    assert moved.cell != placed.cell and moved.reason is Reason.LOAD


def test_a_dead_cell_is_routed_around_and_the_route_says_fallback():
    r = router()
    prompt = ids(1, 8 * BS)
    first = r.route(prompt_keys(prompt, BS))
    r.done(first)
    r.set_alive(first.cell, False)
    again = r.route(prompt_keys(prompt, BS))
    assert again.cell != first.cell and again.reason is Reason.FALLBACK
    r.done(again)
    r.set_alive(first.cell, True)
    longer = prompt_keys(ids(2, 8 * BS), BS)  # one cell holds it: its next turn goes there
    held = r.route(longer)
    r.done(held)
    r.set_alive(held.cell, False)
    r.set_alive(held.cell, True)
    back = r.route(prompt_keys(ids(2, 8 * BS) + ids(3, 2 * BS), BS))
    assert back.cell == held.cell and back.reason is Reason.MATCH


def test_excluded_cells_are_not_chosen_and_none_when_no_cell_is_left():
    r = router(RoutePolicy.LEAST_LOADED)
    route = r.route([], exclude=frozenset({"a", "b", "c"}))
    assert route.cell == "d" and route.reason is Reason.FALLBACK
    assert r.route([], exclude=frozenset(CELLS)) is None


def test_round_robin_takes_each_cell_in_turn():
    r = router(RoutePolicy.ROUND_ROBIN)
    cells = [r.route([]).cell for _ in range(8)]
    assert sorted(cells[:4]) == CELLS and cells[4:] == cells[:4]


def test_least_loaded_counts_the_routes_not_done_and_the_cells_reports():
    r = router(RoutePolicy.LEAST_LOADED)
    held = [r.route([]) for _ in range(4)]
    assert sorted(h.cell for h in held) == CELLS
    r.done(held[2])
    assert r.route([]).cell == held[2].cell
    r.report_load("a", 10)  # a says 10: its 1 from this router and 9 from other gateways
    assert r.load("a") == 10
    assert "a" not in {r.route([]).cell for _ in range(3)}


def test_work_sent_lately_counts_in_a_load_and_halves_every_half_life():
    now = [0.0]
    r = Router(
        CELLS,
        RouterSettings(RoutePolicy.LEAST_LOADED, recent_half_life_s=10.0),
        clock=lambda: now[0],
    )
    first = r.route([], 100, 0)
    r.done(first)
    assert r.load(first.cell) == 100  # finished, but its conversation may come back
    now[0] = 10.0
    assert r.load(first.cell) == 50
    assert r.route([], 100, 0).cell != first.cell  # the others took nothing lately
    now[0] = 1000.0  # (past the rebase: the figures stay exact)
    assert r.load(first.cell) < 1e-20


def test_a_session_sticks_to_one_cell_and_moves_only_when_it_dies():
    r = router(RoutePolicy.SESSION)
    cells = {s: r.route([], session=f"conv-{s}").cell for s in range(40)}
    assert len(set(cells.values())) == 4  # spread over the cells
    assert all(r.route([], session=f"conv-{s}").cell == c for s, c in cells.items())
    r.set_alive("b", False)
    moved = {s: r.route([], session=f"conv-{s}") for s in range(40)}
    assert all(m.cell == cells[s] for s, m in moved.items() if cells[s] != "b")
    assert all(m.reason is Reason.FALLBACK for s, m in moved.items() if cells[s] == "b")
    other = Router(list(reversed(CELLS)), RouterSettings(policy=RoutePolicy.SESSION))
    assert all(other.route([], session=f"conv-{s}").cell == c for s, c in cells.items())


@pytest.mark.parametrize(
    "cells",
    [
        [f"127.0.0.1:{port}" for port in (27801, 27802, 27803)],
        [f"127.0.0.1:{port}" for port in range(50052, 50060)],
        [f"10.0.0.{i}:50052" for i in range(1, 4)],
    ],
)
def test_sessions_spread_evenly_over_the_cells(cells):
    """3,000 sessions per cell: each cell's share within 10% of its fair one. (Rendezvous
    weights were Python's hash of the session's and the cell's digests as a tuple, which
    gave the first cells here 14/37/49% and 4-17%: the sweep of cells.)"""
    r = Router(cells, RouterSettings(policy=RoutePolicy.SESSION))
    n = 3000 * len(cells)
    counts = Counter(r.route([], session=f"conv-{s}").cell for s in range(n))
    assert set(counts) == set(cells)
    assert all(abs(c * len(cells) / n - 1) < 0.1 for c in counts.values()), counts


def test_the_index_holds_at_most_its_capacity_per_cell_forgetting_the_least_recent():
    index = PrefixIndex(capacity=20)
    index.add_cell(0)
    a, b, c = list(range(8)), list(range(100, 108)), list(range(200, 208))
    for keys in (a, b, a, c):  # a touched again after b
        index.insert(0, keys)
        assert index.size(0) <= 20 and len(index.masks) <= 20
    assert index.matches(a, 1) == {0: 8} and index.matches(c, 1) == {0: 8}
    assert index.matches(b, 1) == {}


def test_matching_finds_each_cells_depth_along_the_prompt():
    index = PrefixIndex(capacity=1000)
    for slot in range(3):
        index.add_cell(slot)
    shared, mine = list(range(10)), list(range(10, 30))
    index.insert(0, shared + mine)
    index.insert(1, shared + mine[:5])
    index.insert(2, shared)
    assert index.matches(shared + mine + [99], 0b111) == {0: 30, 1: 15, 2: 10}
    assert index.matches(shared + mine, 0b110) == {1: 15, 2: 10}
    assert index.matches([99, 98, 97], 0b111) == {}  # (keys are chained: a new first, all new)


def test_a_restarted_cell_is_thought_to_hold_nothing():
    r = router()
    prompt = prompt_keys(ids(1, 8 * BS), BS)
    first = r.route(prompt)
    r.restarted(first.cell)
    assert r.index.matches(prompt, r.alive_mask) == {}


def test_settings_are_checked():
    with pytest.raises(ValueError):
        RouterSettings(cache_threshold=1.5)
    with pytest.raises(ValueError):
        RouterSettings(balance_rel_threshold=0.5)


def test_live_router_settings_change_all_or_nothing_and_name_the_one_at_fault():
    from gateway.routing.settings import live_values, with_changes

    s = RouterSettings()
    changed = with_changes(s, {"router": "least-loaded", "router_cache_threshold": "0.5"})
    assert changed.policy is RoutePolicy.LEAST_LOADED and changed.cache_threshold == 0.5
    assert live_values(changed)["router"] == "least-loaded"
    for bad in ({"router": "fastest"}, {"router_cache_threshold": "2"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            with_changes(s, bad)


def test_cell_addresses_keep_each_entry_once_and_an_unresolvable_one_as_given():
    from gateway.cells import cell_addresses

    given = "127.0.0.1:50052, 127.0.0.1:50053,127.0.0.1:50052,no-such-host.invalid:1"
    assert cell_addresses(given) == ["127.0.0.1:50052", "127.0.0.1:50053", "no-such-host.invalid:1"]
