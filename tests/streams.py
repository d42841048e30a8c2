"""Concurrent client streams in threads, watched from the test: tokens so far, outcome, timing."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from llmserve import client


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    final: object | None = None  # the Final message when the stream ended well
    code: grpc.StatusCode | None = None  # the status when it did not
    details: str = ""
    ended_at: float | None = None
    arrivals: list[float] = field(default_factory=list)  # when each delta came

    def longest_gap(self) -> float:
        """The longest wait between two deltas (seconds)."""
        pairs = zip(self.arrivals, self.arrivals[1:], strict=False)
        return max((b - a for a, b in pairs), default=0.0)


class Streams:
    """Start one thread per request; each streams to the end and records its Outcome."""

    def __init__(self, target: str, requests: list, timeout: float = 120.0) -> None:
        self.target, self.timeout = target, timeout
        self.outcomes = [Outcome() for _ in requests]
        self.threads = [
            threading.Thread(target=self._run, args=(r, o), daemon=True)
            for r, o in zip(requests, self.outcomes, strict=True)
        ]
        for t in self.threads:
            t.start()

    def _run(self, request, outcome: Outcome) -> None:
        try:
            for message in client.stream(self.target, request, timeout=self.timeout):
                if message.HasField("final"):
                    outcome.final = message.final
                else:
                    outcome.tokens.extend(message.delta.token_ids)
                    outcome.arrivals.append(time.monotonic())
        except grpc.RpcError as err:
            outcome.code, outcome.details = err.code(), err.details() or ""
        outcome.ended_at = time.monotonic()

    def all_have(self, n: int) -> bool:
        return all(len(o.tokens) >= n or o.ended_at for o in self.outcomes)

    def join(self, timeout: float) -> list[Outcome]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = sum(t.is_alive() for t in self.threads)
        assert not hung, f"{hung} streams still running after {timeout} s"
        return self.outcomes
