"""The gateway's queue limits: requests and prompt tokens submitted but not yet admitted, in
total and per tenant (a key's max_queued and max_queued_tokens: one tenant's burst must not fill
the queue the others need)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueueRefusal:
    """Why a request is refused now; `limit` names the tenant's limit that refused it ("" for
    the gateway's total)."""

    message: str
    tenant: str = ""
    limit: str = ""


class QueueLimits:
    """The gateway's queue limits: requests and prompt tokens not yet admitted to a batch."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.requests = self.tokens = 0
        self.tenant_requests: Counter[str] = Counter()
        self.tenant_tokens: Counter[str] = Counter()

    def refusal(
        self, tokens: int, tenant: str = "", max_requests: int = 0, max_tokens: int = 0
    ) -> QueueRefusal | None:
        """Why a request of `tokens` prompt tokens from `tenant`, whose own limits are
        `max_requests` and `max_tokens` (0 = none), cannot wait now; None if it can."""
        if self.requests >= self.max_requests:
            return QueueRefusal(
                f"queue full: {self.requests} requests are waiting (limit {self.max_requests})"
            )
        if self.tokens + tokens > self.max_tokens:
            return QueueRefusal(
                f"queue full: {self.tokens} prompt tokens are waiting and this request adds "
                f"{tokens} (limit {self.max_tokens})"
            )
        waiting, held = self.tenant_requests[tenant], self.tenant_tokens[tenant]
        if max_requests and waiting >= max_requests:
            return QueueRefusal(
                f"queue full for tenant {tenant}: {waiting} of its requests are waiting (its "
                f"limit max_queued={max_requests})",
                tenant,
                "max_queued",
            )
        if max_tokens and held + tokens > max_tokens:
            return QueueRefusal(
                f"queue full for tenant {tenant}: {held} of its prompt tokens are waiting and "
                f"this request adds {tokens} (its limit max_queued_tokens={max_tokens})",
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
