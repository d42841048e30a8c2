"""Concurrent client streams in threads, watched from the test: tokens so far, outcome, timing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from llmcommon.server import CHANNEL_OPTIONS
from llmcommon.v1 import gateway_pb2_grpc
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


def _record(target: str, request, outcome: Outcome, timeout: float) -> None:
    """Stream `request` to its end, recording tokens, arrivals and how it ended in `outcome`."""
    try:
        for message in client.stream(target, request, timeout=timeout):
            if message.HasField("final"):
                outcome.final = message.final
            else:
                outcome.tokens.extend(message.delta.token_ids)
                outcome.arrivals.append(time.monotonic())
    except grpc.RpcError as err:
        outcome.code, outcome.details = err.code(), err.details() or ""
    outcome.ended_at = time.monotonic()


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
        _record(self.target, request, outcome, self.timeout)

    def all_have(self, n: int) -> bool:
        return all(len(o.tokens) >= n or o.ended_at for o in self.outcomes)

    def join(self, timeout: float) -> list[Outcome]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = sum(t.is_alive() for t in self.threads)
        assert not hung, f"{hung} streams still running after {timeout} s"
        return self.outcomes


class SteadyLoad:
    """`width` clients, each streaming one request after another (request k is `make(k)`) until
    `stop()` or until `limit` requests have started: a load that lasts until the test has seen
    what it waits for, however fast the host. `outcomes[k]` is request k's Outcome."""

    def __init__(
        self, target: str, make: Callable[[int], object], width: int, limit: int,
        timeout: float = 120.0,
    ) -> None:  # fmt: skip
        self.target, self.make, self.limit, self.timeout = target, make, limit, timeout
        self.outcomes: list[Outcome] = []
        self._lock, self._stopped = threading.Lock(), threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(width)]
        for t in self.threads:
            t.start()

    def _next(self) -> tuple[int, Outcome] | None:
        with self._lock:
            if self._stopped.is_set() or len(self.outcomes) >= self.limit:
                return None
            self.outcomes.append(Outcome())
            return len(self.outcomes) - 1, self.outcomes[-1]

    def _client(self) -> None:
        while (item := self._next()) is not None:
            k, outcome = item
            _record(self.target, self.make(k), outcome, self.timeout)

    @property
    def exhausted(self) -> bool:
        """Every request it may start has started (the limit is reached)."""
        with self._lock:
            return len(self.outcomes) >= self.limit

    def stop(self) -> None:
        """Start no more requests; those in flight go on to their end."""
        self._stopped.set()

    def join(self, timeout: float) -> list[Outcome]:
        self.stop()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = sum(t.is_alive() for t in self.threads)
        assert not hung, f"{hung} load clients still streaming after {timeout} s"
        return self.outcomes


class Held:
    """One stream held open until `cancel()`: on a stack whose steps take a floor of time (the
    simulated model's --sim-step-ms), a long request that holds its running slot for as long as
    the test needs. `streaming` is set at its first token (the gateway has seen it admitted)."""

    def __init__(self, target: str, request, timeout: float = 120.0) -> None:
        self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.call = stub.Generate(request, timeout=timeout)
        self.streaming = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        try:
            for _ in self.call:
                self.streaming.set()
        except grpc.RpcError:
            pass

    def cancel(self, timeout: float = 15.0) -> None:
        self.call.cancel()
        self.thread.join(timeout)
        self.channel.close()
