"""Checks on a running stack shared by the fault, load and fuzz tests: idle KV, resident memory,
clean exits, greedy generations."""

from __future__ import annotations

import time
from pathlib import Path

from llmcommon.v1 import scheduler_pb2
from llmserve import client
from llmserve.stack import Stack


def is_idle(status: scheduler_pb2.StatusReply) -> bool:
    return (
        status.waiting == 0
        and status.running == 0
        and all(w.written == 0 and w.reserved_unwritten == 0 for w in status.workers)
        and all(w.free == w.capacity for w in status.workers if w.healthy)
    )


def wait_idle(scheduler: str, timeout: float = 30.0) -> scheduler_pb2.StatusReply:
    """The scheduler's status once nothing waits or runs and all KV is free; fail after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        status = client.status(scheduler)
        if is_idle(status):
            return status
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {status}"
        time.sleep(0.05)


def wait_for(predicate, timeout: float, what: str, period: float = 0.02):
    """Poll `predicate()` until it returns something truthy; fail naming `what` after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(period)


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of a process (VmRSS; VmHWM for its peak so far), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def stack_rss(stack: Stack) -> dict[str, int]:
    return {name: rss_kib(proc.pid) for name, proc in stack.procs.items()}


def stop_cleanly(stack: Stack) -> None:
    """SIGTERM every process (gateway first); each must exit 0 within the grace period."""
    alive = {name for name, proc in stack.procs.items() if proc.poll() is None}
    codes = stack.stop()
    assert {n: c for n, c in codes.items() if n in alive} == dict.fromkeys(alive, 0), codes


def greedy_request(i: int, max_tokens: int):
    return client.make_request(
        prompt=f"Request {i}: the story goes", max_tokens=max_tokens, temperature=0.0,
        ignore_eos=True,
    )  # fmt: skip


def generate(target: str, request, timeout: float = 120.0) -> tuple[list[int], object]:
    """Stream one request to the end: (token ids, the Final message)."""
    messages = list(client.stream(target, request, timeout=timeout))
    ids = [t for m in messages[:-1] for t in m.delta.token_ids]
    return ids, messages[-1].final
