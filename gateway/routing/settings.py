"""The router's policies and thresholds: one frozen, validated value, replaced as a whole when
an operator changes it live."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

from llmcommon.flags import field_name, setting


class RoutePolicy(Enum):
    CACHE_AWARE = "cache-aware"  # the cell that cached most of the prompt, unless loads say no
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"
    SESSION = "session"  # a conversation id (or the user) sticks to one cell


FLOATS = (
    "cache_threshold", "balance_abs_threshold", "balance_rel_threshold", "load_weight",
    "recent_half_life_s",
)  # fmt: skip
MAX_INDEX_BLOCKS = 1 << 22  # per cell: 4 M keys, some 400 MB of the gateway's memory at most


@dataclass(frozen=True, slots=True)
class RouterSettings:
    policy: RoutePolicy = setting(
        RoutePolicy.CACHE_AWARE,
        "how a request's cell is chosen: cache-aware (the cell that cached most of its prompt, "
        "unless loads are unbalanced), least-loaded, round-robin, session (a conversation id or "
        "the user sticks to a cell)",
    )
    cache_threshold: float = setting(
        0.3, "cache-aware: below this share of the prompt's blocks matched in a cell, by load"
    )
    balance_abs_threshold: float = setting(
        4096.0,
        "cache-aware: loads are unbalanced (the least loaded cell, whatever the match) when the "
        "most loaded cell's load (tokens of work in flight) exceeds the least loaded's by more "
        "than this...",
    )
    balance_rel_threshold: float = setting(1.5, "... and by more than this many times")
    load_weight: float = setting(
        1.0,
        "cache-aware: score = matched share - this x load / the request's tokens (prompt and "
        "output): at 1, a cell's load in tokens of work weighs what its cache saves",
    )
    recent_half_life_s: float = setting(
        30.0,
        "the work a cell was sent lately counts in its load, halving every this many seconds "
        "(its conversations' next turns will follow); 0 = only the work in flight",
    )
    block_size: int = setting(16, "the cells' KV block size, in tokens (from their status)")
    index_blocks: int = setting(
        32768, "per cell, at most this many block keys remembered (the oldest forgotten first)"
    )
    max_prompt_blocks: int = setting(1024, "at most this many leading blocks of a prompt keyed")

    def __post_init__(self) -> None:
        for name in FLOATS:
            value = getattr(self, name)
            if not math.isfinite(value):  # nan passed every comparison; inf, an absurd bound
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.index_blocks > MAX_INDEX_BLOCKS:
            raise ValueError(
                f"index_blocks must be at most {MAX_INDEX_BLOCKS} (a dict entry a block key a "
                f"cell), got {self.index_blocks}"
            )
        if not isinstance(self.policy, RoutePolicy):
            raise ValueError(f"policy must be a RoutePolicy, got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.recent_half_life_s < 0:
            raise ValueError(f"recent_half_life_s must be >= 0, got {self.recent_half_life_s}")
        if self.load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")
        if self.index_blocks < 1 or self.max_prompt_blocks < 1 or self.block_size < 1:
            raise ValueError("index_blocks, max_prompt_blocks and block_size must be >= 1")


def parse_policy(text: str) -> RoutePolicy:
    try:
        return RoutePolicy(text)
    except ValueError:
        known = ", ".join(p.value for p in RoutePolicy)
        raise ValueError(f"router policy {text!r}: want one of {known}") from None


# The router's live settings, as `llmserve set` names them (the gateway's flags without "--")
LIVE = {
    "router": "policy",
    "router_cache_threshold": "cache_threshold",
    "router_balance_abs_threshold": "balance_abs_threshold",
    "router_balance_rel_threshold": "balance_rel_threshold",
    "router_load_weight": "load_weight",
    "router_index_blocks": "index_blocks",
    "router_recent_half_life_s": "recent_half_life_s",
}


def live_values(settings: RouterSettings) -> dict[str, str]:
    """Each live setting's value, as its flag takes it."""
    out = {}
    for name, field in LIVE.items():
        value = getattr(settings, field)
        out[name] = value.value if isinstance(value, RoutePolicy) else str(value)
    return out


def with_changes(settings: RouterSettings, changes: dict[str, str]) -> RouterSettings:
    """`settings` with `changes` (live names, flag values); ValueError naming the one at fault,
    and nothing changed."""
    given = {}
    for name, text in changes.items():
        field = LIVE[field_name(name)]
        kind = type(getattr(settings, field))
        try:
            given[field] = parse_policy(text) if field == "policy" else kind(text)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    try:
        return replace(settings, **given)
    except ValueError as err:
        raise ValueError(f"{', '.join(changes)}: {err}") from None
