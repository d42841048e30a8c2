"""The router's policies and thresholds: one frozen, validated value, replaced as a whole when
an operator changes it live."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RoutePolicy(Enum):
    CACHE_AWARE = "cache-aware"  # the cell that cached most of the prompt, unless loads say no
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"
    SESSION = "session"  # a conversation id (or the user) sticks to one cell


@dataclass(frozen=True, slots=True)
class RouterSettings:
    policy: RoutePolicy = RoutePolicy.CACHE_AWARE
    # cache-aware: below this share of the prompt's blocks matched in any cell, route by load
    cache_threshold: float = 0.3
    # cache-aware: loads are unbalanced (route to the least loaded, whatever the match) when the
    # most loaded cell's load exceeds the least loaded's by more than `balance_abs_threshold`
    # and by more than `balance_rel_threshold` times
    balance_abs_threshold: float = 8.0
    balance_rel_threshold: float = 1.5
    # cache-aware: score = matched share - load_weight x (load / the most loaded cell's)
    load_weight: float = 0.5
    # per cell, at most this many block keys remembered (least recently routed forgotten first)
    index_blocks: int = 32768
    # at most this many leading blocks of a prompt are keyed (bounds the hashing per request)
    max_prompt_blocks: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.policy, RoutePolicy):
            raise ValueError(f"policy must be a RoutePolicy, got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")
        if self.index_blocks < 1 or self.max_prompt_blocks < 1:
            raise ValueError("index_blocks and max_prompt_blocks must be >= 1")


def parse_policy(text: str) -> RoutePolicy:
    try:
        return RoutePolicy(text)
    except ValueError:
        known = ", ".join(p.value for p in RoutePolicy)
        raise ValueError(f"router policy {text!r}: want one of {known}") from None
