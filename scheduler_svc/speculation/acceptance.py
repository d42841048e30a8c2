"""A request's running acceptance rate (the per-token probability that a draft token is kept)
and what a draft is expected to emit under it. No imports: the request's state holds its rate."""

from __future__ import annotations

ACCEPT_PRIOR = 0.5  # a request's acceptance rate before its first draft
ACCEPT_WEIGHT = 0.3  # of the latest draft in the running rate


def expected_emitted(rate: float, k: int) -> float:
    """Tokens a draft of `k` emits on average, the worker's own one included."""
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def next_rate(rate: float, drafted: int, accepted: int) -> float:
    """The running acceptance rate after a draft of `drafted` tokens of which the first
    `accepted` were kept: the draft's own estimate (accepted over the tokens tried: one more
    than accepted when one was rejected) averaged in with weight ACCEPT_WEIGHT."""
    if drafted <= 0:
        return rate
    tried = accepted + (accepted < drafted)
    return rate + ACCEPT_WEIGHT * (accepted / tried - rate)
