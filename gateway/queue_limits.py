"""The gateway's queue limits: requests and prompt tokens submitted but not yet admitted."""

from __future__ import annotations


class QueueLimits:
    """The gateway's queue limits: requests and prompt tokens not yet admitted to a batch."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.requests = self.tokens = 0

    def refusal(self, tokens: int) -> str | None:
        if self.requests >= self.max_requests:
            return f"queue full: {self.requests} requests are waiting (limit {self.max_requests})"
        if self.tokens + tokens > self.max_tokens:
            return (
                f"queue full: {self.tokens} prompt tokens are waiting and this request adds "
                f"{tokens} (limit {self.max_tokens})"
            )
        return None

    def enter(self, tokens: int) -> None:
        self.requests += 1
        self.tokens += tokens

    def leave(self, tokens: int) -> None:
        self.requests -= 1
        self.tokens -= tokens
