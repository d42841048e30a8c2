"""The routing decision: a request's block keys (and session) in, a cell and the reason out.

cache-aware (after SGLang's cache_aware policy and vLLM production stack's score):
1. loads unbalanced (the most loaded cell's load exceeds the least loaded's by more than
   `balance_abs_threshold` and by more than `balance_rel_threshold` times): the least loaded;
2. no live cell holds `cache_threshold` of the prompt's blocks: the least loaded;
3. else the best score, matched share - `load_weight` x load / the request's own tokens (the
   least loaded cell, when it scores best, makes the route LOAD).
least-loaded: the least loaded (ties in turn); round-robin: in turn; session: rendezvous
hashing of the session over the live cells (the least loaded when the request has none).

A cell's load is the work the router has routed there and not yet seen finish (each request its
prompt tokens not cached there and its output tokens), plus what the cell reports beyond that
(other gateways' requests).
A route that avoided a dead, hung or excluded cell it would have chosen says FALLBACK.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from itertools import compress, repeat

from gateway.routing.prefix_index import PrefixIndex, bits
from gateway.routing.settings import RoutePolicy, RouterSettings
from gateway.routing.sticky import digest64


class Reason(Enum):
    MATCH = "match"  # the cell holding most of the prompt
    LOAD = "load"  # the least loaded (no match worth it, or loads unbalanced)
    ROTATION = "round-robin"
    SESSION = "session"  # the session's cell
    FALLBACK = "fallback"  # the cell it would have gone to is dead, hung or excluded


@dataclass(frozen=True, slots=True)
class Route:
    cell: str
    reason: Reason
    matched_blocks: int  # of the prompt's leading blocks, those the cell is thought to hold
    prompt_blocks: int
    weight: float = 1.0  # what it adds to the cell's load until `Router.done`

    @property
    def matched_share(self) -> float:
        return self.matched_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


class Router:
    def __init__(self, cells: list[str], settings: RouterSettings | None = None) -> None:
        self.settings = settings or RouterSettings()
        self.index = PrefixIndex(self.settings.index_blocks)
        self.slots: dict[str, int] = {}
        self.names: list[str | None] = []
        self.digests: list[int] = []
        self.inflight: list[float] = []  # per slot: the weights routed and not done
        self.extra: list[float] = []  # per slot: the load it reports beyond this router's own
        self.loads: list[float] = []  # per slot: inflight + extra
        self.alive_mask = 0
        self.members = 0  # bit mask of the slots that name a cell
        self.turn = 0
        self._live: tuple[int, list[int], list[int]] = (0, [], [])  # a mask, slots, digests
        for name in cells:
            self.add_cell(name)

    # ---- membership and load -------------------------------------------------------------

    def add_cell(self, name: str) -> None:
        """A cell joins (or comes back): it takes traffic, with an empty index if new."""
        if name in self.slots:
            self.set_alive(name, True)
            return
        free = [s for s, n in enumerate(self.names) if n is None]
        slot = free[0] if free else len(self.names)
        if not free:
            for column in (self.names, self.digests, self.inflight, self.extra, self.loads):
                column.append(0)  # type: ignore[arg-type]
        self.names[slot], self.digests[slot] = name, digest64(name)
        self.inflight[slot] = self.extra[slot] = self.loads[slot] = 0.0
        self.slots[name] = slot
        self.index.add_cell(slot)
        self.alive_mask |= 1 << slot
        self.members |= 1 << slot

    def remove_cell(self, name: str) -> None:
        slot = self.slots.pop(name)
        self.index.remove_cell(slot)
        self.names[slot] = None
        self.alive_mask &= ~(1 << slot)
        self.members &= ~(1 << slot)

    def set_alive(self, name: str, alive: bool) -> None:
        """A dead or hung cell takes no traffic until it answers again."""
        bit = 1 << self.slots[name]
        self.alive_mask = self.alive_mask | bit if alive else self.alive_mask & ~bit

    def restarted(self, name: str) -> None:
        """The cell's cache is empty (its scheduler restarted): forget what it held."""
        self.index.remove_cell(self.slots[name])

    def alive(self, name: str) -> bool:
        return bool(self.alive_mask >> self.slots[name] & 1)

    def report_load(self, name: str, load: float) -> None:
        """The cell's own figure for its load (all gateways' requests, same unit as weights)."""
        slot = self.slots[name]
        self.extra[slot] = max(0.0, load - self.inflight[slot])
        self.loads[slot] = self.inflight[slot] + self.extra[slot]

    def load(self, name: str) -> float:
        return self.loads[self.slots[name]]

    def configure(self, settings: RouterSettings) -> None:
        """Live: new thresholds or policy; the index is kept (resized from the next insert)."""
        self.settings = settings
        self.index.capacity = settings.index_blocks

    # ---- the decision --------------------------------------------------------------------

    def route(
        self,
        keys: list[int],
        prompt_tokens: int = 0,
        output_tokens: int = 0,
        session: str = "",
        exclude: frozenset[str] = frozenset(),
    ) -> Route | None:
        """The cell for a request whose prompt has block keys `keys` (prompt_keys) of its
        `prompt_tokens`, asking for up to `output_tokens`; None when no live cell is left. The
        route adds its work (the prompt tokens not cached there and the output, at least 1) to
        the cell's load until `done`."""
        among = self.alive_mask
        for name in exclude:
            slot = self.slots.get(name)
            if slot is not None:
                among &= ~(1 << slot)
        if not among:
            return None
        size = float(max(1, prompt_tokens + output_tokens))
        preferred = None if among == self.members else self._would_choose(keys, session, size)
        depths = self.index.depths(keys, among)
        slot, reason = self._choose(among, depths, len(keys), session, size)
        if preferred is not None and not among >> preferred & 1:
            reason = Reason.FALLBACK
        self.index.insert(slot, keys)
        matched = _depth_of(depths, slot)
        cached = min(prompt_tokens, matched * self.settings.block_size)
        weight = float(max(1, prompt_tokens - cached + output_tokens))
        self.inflight[slot] += weight
        self.loads[slot] += weight
        return Route(self.names[slot], reason, matched, len(keys), weight)  # type: ignore[arg-type]

    def done(self, route: Route) -> None:
        """The request `route` placed has finished (or left that cell)."""
        slot = self.slots.get(route.cell)
        if slot is not None:
            self.inflight[slot] = max(0.0, self.inflight[slot] - route.weight)
            self.loads[slot] = self.inflight[slot] + self.extra[slot]

    def _choose(
        self, among: int, depths: list[tuple[int, int]], blocks: int, session: str, size: float
    ) -> tuple[int, Reason]:
        policy = self.settings.policy
        live, digests = self._slots(among)
        if policy is RoutePolicy.ROUND_ROBIN:
            self.turn += 1
            return live[self.turn % len(live)], Reason.ROTATION
        if policy is RoutePolicy.SESSION and session:
            return _rendezvous(session, live, digests), Reason.SESSION
        if policy is RoutePolicy.CACHE_AWARE:
            chosen = self._by_match(live, depths, blocks, size)
            if chosen is not None:
                return chosen, Reason.MATCH
        return self._least_loaded(live), Reason.LOAD

    def _by_match(
        self, live: list[int], depths: list[tuple[int, int]], blocks: int, size: float
    ) -> int | None:
        """cache-aware's choice, or None to route by load. Each cell scores its matched share
        of the prompt's blocks less `load_weight` x its load relative to this request's size
        (its prompt and output tokens): a cell is worth its load in work for the prompt it
        would not recompute. Within a depth the least loaded scores best, so one cell a depth
        is scored, and the least loaded cell of all."""
        s, loads = self.settings, self.loads
        if not depths or depths[-1][0] < s.cache_threshold * blocks:
            return None
        load = loads.__getitem__
        idle = min(live, key=load)
        lo, hi = loads[idle], max(map(load, live))
        if hi - lo > s.balance_abs_threshold and hi > s.balance_rel_threshold * lo:
            return None
        beta = s.load_weight / size
        # a prefix that several cells hold is one every cell soon holds (a shared system
        # prompt): the least loaded is credited with it, so that it spreads new conversations
        shared = max((d for d, mask in depths if mask & (mask - 1)), default=0)
        held = _depth_of(depths, idle)
        best, score = idle, (max(held, shared) / blocks - beta * lo, held)
        for depth, mask in depths:  # (equal scores: the cell that holds more)
            slot = idle if mask >> idle & 1 else min(bits(mask), key=load)
            mine = (depth / blocks - beta * loads[slot], depth)
            if mine > score:
                best, score = slot, mine
        if _depth_of(depths, best) < s.cache_threshold * blocks:
            return None  # (the least loaded won: by load)
        return best

    def _least_loaded(self, live: list[int]) -> int:
        """The least loaded of `live`; among equals, the next in turn."""
        load = self.loads.__getitem__
        low = min(map(load, live))
        ties = list(compress(live, map(low.__eq__, map(load, live))))
        self.turn += 1
        return ties[self.turn % len(ties)]

    def _slots(self, mask: int) -> tuple[list[int], list[int]]:
        """The slots of `mask` and their names' digests (kept for the last mask asked)."""
        if self._live[0] != mask:
            slots = bits(mask)
            self._live = (mask, slots, [self.digests[s] for s in slots])
        return self._live[1], self._live[2]

    def _would_choose(self, keys: list[int], session: str, size: float) -> int:
        """Where the request would go were every cell up (nothing changed): for FALLBACK."""
        everyone, turn, live = self.members, self.turn, self._live
        depths = self.index.depths(keys, everyone)
        slot, _ = self._choose(everyone, depths, len(keys), session, size)
        self.turn, self._live = turn, live
        return slot


def _depth_of(depths: list[tuple[int, int]], slot: int) -> int:
    return next((d for d, mask in depths if mask >> slot & 1), 0)


def _rendezvous(session: str, live: list[int], digests: list[int]) -> int:
    """Rendezvous (highest random weight) hashing: the slot of `live` whose weight, a hash of
    the session's digest and the cell name's, is highest. Every gateway picks the same cell for
    a session (a tuple of ints hashes alike in every process of one Python version; only str
    and bytes hashes are salted), and a cell that leaves moves only its own sessions."""
    weights = map(hash, zip(repeat(digest64(session)), digests))
    return max(zip(weights, live, strict=False))[1]
