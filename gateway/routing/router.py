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
(other gateways' requests). Where a request goes by load, the work each cell was sent lately
counts too, halving every `recent_half_life_s`: conversations stick to the cell of their
history, so the cell that took many lately will be sent their next turns, in flight or not yet;
new conversations go where fewer live.
A route that avoided a dead, hung or excluded cell it would have chosen says FALLBACK.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from itertools import compress

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
    def __init__(
        self,
        cells: list[str],
        settings: RouterSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or RouterSettings()
        self.clock = clock
        self.index = PrefixIndex(self.settings.index_blocks)
        self.slots: dict[str, int] = {}
        self.names: list[str | None] = []
        self.digests: list[int] = []
        self.inflight: list[float] = []  # per slot: the weights routed and not done
        self.extra: list[float] = []  # per slot: the load it reports beyond this router's own
        self.recent: list[float] = []  # per slot: work sent lately, x 2^((now - base) / half-life)
        self.base = clock()
        self.loads: list[float] = []  # per slot: inflight + extra
        self.decay = 1.0  # what work sent at `base` counts, as of the route being decided
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
            columns = (
                self.names, self.digests, self.inflight, self.extra, self.recent, self.loads,
            )  # fmt: skip
            for column in columns:
                column.append(0)  # type: ignore[arg-type]
        self.names[slot], self.digests[slot] = name, cell_factor(name)
        self.inflight[slot] = self.extra[slot] = self.recent[slot] = 0.0
        self.loads[slot] = 0.0
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

    def load(self, name: str, lately: bool = True) -> float:
        """The cell's load: in flight, and (`lately`) the work it was sent lately."""
        slot, f = self.slots[name], self._decay()  # (first: it may rebase `recent`)
        return self.inflight[slot] + self.extra[slot] + lately * self.recent[slot] * f

    def _decay(self) -> float:
        """What work sent at `base` still counts now (recent work is stored as of `base`)."""
        half = self.settings.recent_half_life_s
        if not half:
            return 0.0
        ages = (self.clock() - self.base) / half
        if ages > 32:  # rebase before the stored figures grow past what a float holds well
            self.recent = [r * 2.0**-ages for r in self.recent]
            self.base, ages = self.clock(), 0.0
        return 2.0**-ages

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
        decay = self.decay = self._decay()
        size = float(max(1, prompt_tokens + output_tokens))
        preferred = None if among == self.members else self._would_choose(keys, session, size)
        depths = self.index.depths(keys, among)
        slot, reason = self._choose(among, depths, keys, session, size)
        if preferred is not None and not among >> preferred & 1:
            reason = Reason.FALLBACK
        matched = _depth_of(depths, slot)
        if 0 < matched < len(keys):
            self.index.branched(keys[matched - 1])
        self.index.insert(slot, keys)
        cached = min(prompt_tokens, matched * self.settings.block_size)
        weight = float(max(1, prompt_tokens - cached + output_tokens))
        self.inflight[slot] += weight
        self.loads[slot] += weight
        if decay:
            self.recent[slot] += weight / decay
        return Route(self.names[slot], reason, matched, len(keys), weight)  # type: ignore[arg-type]

    def done(self, route: Route) -> None:
        """The request `route` placed has finished (or left that cell)."""
        slot = self.slots.get(route.cell)
        if slot is not None:
            self.inflight[slot] = max(0.0, self.inflight[slot] - route.weight)
            self.loads[slot] = self.inflight[slot] + self.extra[slot]

    def _choose(
        self, among: int, depths: list[tuple[int, int]], keys: list[int], session: str, size: float
    ) -> tuple[int, Reason]:
        policy = self.settings.policy
        live, digests = self._slots(among)
        if policy is RoutePolicy.ROUND_ROBIN:
            self.turn += 1
            return live[self.turn % len(live)], Reason.ROTATION
        if policy is RoutePolicy.SESSION and session:
            return _rendezvous(session, live, digests), Reason.SESSION
        if policy is RoutePolicy.CACHE_AWARE:
            chosen = self._by_match(live, depths, keys, size)
            if chosen is not None:
                return chosen, Reason.MATCH
        return self._least_loaded(live), Reason.LOAD

    def _by_match(
        self, live: list[int], depths: list[tuple[int, int]], keys: list[int], size: float
    ) -> int | None:
        """cache-aware's choice, or None to route by load. Each cell scores its matched share
        of the prompt's blocks less `load_weight` x its load relative to this request's size
        (its prompt and output tokens): a cell is worth its load in work for the prompt it
        would not recompute. The deepest match's least loaded cell is scored against the least
        loaded cell of all, credited with the shared prefix it would soon hold."""
        s, loads, blocks = self.settings, self.loads, len(keys)
        if not depths or depths[-1][0] < s.cache_threshold * blocks:
            return None
        load = loads.__getitem__
        least, hi = min(map(load, live)), max(map(load, live))
        if hi - least > s.balance_abs_threshold and hi > s.balance_rel_threshold * least:
            return None
        idle = self._least_loaded(live)  # where it goes if not to its match
        lo = loads[idle]
        beta = s.load_weight / size
        # a shared prefix (a system prompt: several cells hold it, or other prompts branched
        # off where this one does) is one every cell soon holds: the least loaded is credited
        # with it, so that new conversations spread; a history only one cell holds, and that
        # only its own next turn extends, is not
        shared = max((d for d, mask in depths if self.index.shared(keys[d - 1], mask)), default=0)
        depth, mask = depths[-1]
        if depth <= shared:
            return None  # only a shared prefix matches: by load
        best = idle if mask >> idle & 1 else min(bits(mask), key=load)
        held = max(_depth_of(depths, idle), shared)
        if depth / blocks - beta * loads[best] >= held / blocks - beta * lo:
            return best
        return None  # (the least loaded scores best: by load)

    def _least_loaded(self, live: list[int]) -> int:
        """The least loaded of `live` (counting the work sent lately); among equals, the next
        in turn."""
        loads, recent, f = self.loads, self.recent, self.decay
        spread = [loads[slot] + recent[slot] * f for slot in live]
        low = min(spread)
        ties = list(compress(live, map(low.__eq__, spread)))
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
        slot, _ = self._choose(everyone, depths, keys, session, size)
        self.turn, self._live = turn, live
        return slot


def _depth_of(depths: list[tuple[int, int]], slot: int) -> int:
    return next((d for d, mask in depths if mask >> slot & 1), 0)


MASK64 = (1 << 64) - 1


def cell_factor(name: str) -> int:
    """The cell's odd 64-bit multiplier for rendezvous hashing: its name's digest, mixed by
    splitmix64's finalizer (every bit of the digest moves every bit of the factor)."""
    x = digest64(name)
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return (x ^ (x >> 31)) | 1


def _rendezvous(session: str, live: list[int], factors: list[int]) -> int:
    """Rendezvous (highest random weight) hashing: the slot of `live` whose weight, the
    session's 64-bit digest times the cell's factor (mod 2^64), is highest. Every gateway picks
    the same cell for a session (digests and factors are the same in every process), a cell
    that leaves moves only its own sessions, and sessions spread evenly: 33.1-33.8% per cell
    over 3 cells, 12.3-12.8% over 8 (30,000 names each). (Python's hash of the two digests as
    a tuple, before, gave 14/37/49% over 3 cells, 4-17% over 8.)"""
    s = digest64(session)
    return max(zip([s * f & MASK64 for f in factors], live, strict=True))[1]
