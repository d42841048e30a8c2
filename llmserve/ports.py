"""Free loopback ports for stacks started by tests and benchmarks."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free right now (held together while chosen, so never equal)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def free_run(n: int, taken: list[int] | tuple[int, ...] = ()) -> int:
    """The first of `n` consecutive free ports, none of them in `taken` (workers and metrics
    ports are numbered base, base+1, ...)."""
    while True:
        run = range(start := free_port(), start + n)
        if run.stop < 65536 and not set(run) & set(taken) and all(map(is_free, run)):
            return start


def is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
