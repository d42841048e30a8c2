"""The gateway's queue limits: requests and prompt tokens submitted but not yet admitted, in
total and per tenant (a key's max_queued and max_queued_tokens: one tenant's burst must not fill
the queue the others need)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueueRefusal:
    """Why a request is refused now; `limit` names the tenant's limit that refused it ("" for
    the gateway's total). `never`: the request alone is over the limit (its prompt, or its `n`
    choices), so no retry can succeed: the client must change it."""

    message: str
    tenant: str = ""
    limit: str = ""
    never: bool = False
    param: str | None = None  # the request's field at fault, where one is


class QueueLimits:
    """The gateway's queue limits: requests and prompt tokens not yet admitted to a batch."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.requests = self.tokens = 0
        self.tenant_requests: Counter[str] = Counter()
        self.tenant_tokens: Counter[str] = Counter()

    def refusal(
        self,
        tokens: int,
        tenant: str = "",
        max_requests: int = 0,
        max_tokens: int = 0,
        n: int = 1,
    ) -> QueueRefusal | None:
        """Why `n` requests (a request's choices) of `tokens` prompt tokens each from `tenant`,
        whose own limits are `max_requests` and `max_tokens` (0 = none), cannot wait now; None
        if they can."""
        # what no wait can change first (the gateway's limits, then the tenant's), then
        # what is full now
        alone = _over_alone(tokens, n, self.max_requests, self.max_tokens, "the gateway's")
        if alone is not None:
            return QueueRefusal(alone, never=True, param=_param(n, self.max_requests))
        alone = _over_alone(tokens, n, max_requests, max_tokens, f"tenant {tenant}'s")
        if alone is not None:
            param = _param(n, max_requests)
            limit = "max_queued" if param else "max_queued_tokens"
            return QueueRefusal(alone, tenant, limit, never=True, param=param)
        if self.requests + n > self.max_requests:
            return QueueRefusal(
                f"queue full: {self.requests} requests are waiting (limit {self.max_requests})"
                + _choices(n)
            )
        if self.tokens + n * tokens > self.max_tokens:
            return QueueRefusal(
                f"queue full: {self.tokens} prompt tokens are waiting and this request adds "
                f"{n * tokens} (limit {self.max_tokens})"
            )
        waiting, held = self.tenant_requests[tenant], self.tenant_tokens[tenant]
        if max_requests and waiting + n > max_requests:
            return QueueRefusal(
                f"queue full for tenant {tenant}: {waiting} of its requests are waiting (its "
                f"limit max_queued={max_requests})" + _choices(n),
                tenant,
                "max_queued",
            )
        if max_tokens and held + n * tokens > max_tokens:
            return QueueRefusal(
                f"queue full for tenant {tenant}: {held} of its prompt tokens are waiting and "
                f"this request adds {n * tokens} (its limit max_queued_tokens={max_tokens})",
                tenant,
                "max_queued_tokens",
            )
        return None

    def enter(self, tokens: int, tenant: str = "") -> None:
        self.requests += 1
        self.tokens += tokens
        self.tenant_requests[tenant] += 1
        self.tenant_tokens[tenant] += tokens

    def leave(self, tokens: int, tenant: str = "") -> None:
        self.requests -= 1
        self.tokens -= tokens
        self.tenant_requests[tenant] -= 1
        self.tenant_tokens[tenant] -= tokens


def _over_alone(tokens: int, n: int, max_requests: int, max_tokens: int, whose: str) -> str | None:
    """Why `n` choices of `tokens` prompt tokens are over the limits on an empty queue (0 =
    none), or None."""
    if max_requests and n > max_requests:
        return (
            f"n is {n}: its choices wait as {n} requests, over {whose} queue limit of "
            f"{max_requests}; ask for fewer choices"
        )
    if max_tokens and n * tokens > max_tokens:
        told = f"{n} choices of {tokens}" if n > 1 else f"{tokens}"
        return (
            f"the prompt ({told} tokens) is over {whose} queue limit of {max_tokens} prompt "
            "tokens: it can never wait there; shorten it"
            + ("" if n == 1 else " or ask for fewer choices")
        )
    return None


def _param(n: int, max_requests: int) -> str | None:
    """The field at fault when a request alone is over a limit: its `n`, or its prompt (no
    one field: `messages` or `prompt`)."""
    return "n" if max_requests and n > max_requests else None


def _choices(n: int) -> str:
    return "" if n == 1 else f" and this request's {n} choices would wait as {n}"


class QueueClaim:
    """The queue places of one request's `n` choices, taken together (each choice is a request
    to the scheduler of its own): the first choice to reach the queue checks the limits for all
    `n` and enters them all; each choice then takes the place held for it, or the same refusal.
    `close()`, when the request ends, gives back the places no choice took (a choice that
    failed or was cancelled before it reached the queue). Nothing of a refused request is ever
    queued."""

    def __init__(self, queue: QueueLimits, n: int = 1) -> None:
        self.queue, self.n = queue, n
        self.checked = False
        self.refused: QueueRefusal | None = None
        self.held = 0  # places entered for choices that have not taken them yet
        self.tokens, self.tenant = 0, ""
        self.told = False  # the refusal was counted (once for the request, not per choice)

    def first_refusal(self) -> bool:
        """True the first time it is asked: the refusal is counted once for all the choices."""
        first, self.told = not self.told, True
        return first

    def take(
        self, tokens: int, tenant: str, max_requests: int = 0, max_tokens: int = 0
    ) -> QueueRefusal | None:
        """This choice's place (entered in the queue), or why the request may not wait."""
        if not self.checked:
            self.checked = True
            self.refused = self.queue.refusal(tokens, tenant, max_requests, max_tokens, self.n)
            if self.refused is None:
                self.tokens, self.tenant, self.held = tokens, tenant, self.n
                for _ in range(self.n):
                    self.queue.enter(tokens, tenant)
        if self.refused is not None:
            return self.refused
        if self.held == 0:
            raise RuntimeError(f"more choices took a place than the {self.n} claimed")
        self.held -= 1
        return None

    def close(self) -> None:
        """The request ended: the places its choices did not take leave the queue."""
        while self.held:
            self.held -= 1
            self.queue.leave(self.tokens, self.tenant)
