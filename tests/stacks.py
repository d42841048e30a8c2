"""Real processes on loopback for end-to-end tests: free ports and a running stack."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from llmserve.ports import free_port, free_ports, free_run

__all__ = ["free_port", "free_run", "running_stack", "tiny_settings"]
from llmserve.stack import Stack, StackSettings


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
        settings = replace(settings, worker_base_port=free_run(workers, ports[:2]))
    return settings


@contextmanager
def running_stack(settings: StackSettings, log_dir: Path):
    stack = Stack(settings, log_dir)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def with_http_port(settings: StackSettings) -> StackSettings:
    """`settings` with an HTTP port of its own, free and apart from the stack's gRPC ports."""
    taken = [settings.gateway_port, settings.scheduler_port, settings.worker_base_port]
    return replace(settings, http_port=free_run(1, taken))
