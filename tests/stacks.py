"""Real processes on loopback for end-to-end tests: free ports and a running stack."""

from __future__ import annotations

import socket
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from llmserve.stack import Stack, StackSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tiny_settings(**overrides) -> StackSettings:
    """A stack on free ports with the tiny random model (fast); override anything."""
    workers = overrides.get("workers", 1)
    ports = free_ports(2 + workers)
    base = StackSettings(
        model="tiny",
        dtype="fp32",
        gateway_port=ports[0],
        scheduler_port=ports[1],
        worker_base_port=ports[2],
        threads=1,
    )
    settings = replace(base, **overrides)
    if workers > 1:  # worker ports must be consecutive: find a free run
        start = free_port()
        while not all(_is_free(start + i) for i in range(workers)):
            start = free_port()
        settings = replace(settings, worker_base_port=start)
    return settings


def free_run(n: int) -> int:
    """The first of `n` consecutive free ports (e.g. for --metrics-base-port)."""
    start = free_port()
    while not all(_is_free(start + i) for i in range(n)):
        start = free_port()
    return start


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@contextmanager
def running_stack(settings: StackSettings, log_dir: Path):
    stack = Stack(settings, log_dir)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()
