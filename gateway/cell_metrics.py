"""The gateway's metrics of its cells (with --cells): where requests were routed and why, the
share of their prompts' blocks the chosen cell was thought to hold (the routed hit rate), and
each cell's load and health as the router sees them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.cells import Cells
from gateway.routing import Reason, Route


class CellMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.routed = Counter(
            "llmserve_gateway_routed",
            "Requests routed to a cell, by cell and reason (match, load, round-robin, session, "
            "fallback)",
            ["cell", "reason"],
            registry=registry,
        )
        self.prompt_blocks = Counter(
            "llmserve_gateway_routed_prompt_blocks",
            "Full KV blocks of the prompts routed to a cell",
            ["cell"],
            registry=registry,
        )
        self.matched_blocks = Counter(
            "llmserve_gateway_routed_matched_blocks",
            "Of those, the leading blocks the router thought the cell held (over the prompt "
            "blocks: the routed hit rate)",
            ["cell"],
            registry=registry,
        )
        self.load = Gauge(
            "llmserve_gateway_cell_load",
            "A cell's load as the router sees it: tokens of work in flight (prompt tokens not "
            "cached there and output tokens asked), with what the cell reports beyond",
            ["cell"],
            registry=registry,
        )
        self.alive = Gauge(
            "llmserve_gateway_cell_up",
            "1 while a cell answers its health checks and takes traffic, else 0",
            ["cell"],
            registry=registry,
        )

    def follow(self, cells: Cells) -> None:
        """Every cell's series, from the router's state (cells that join are added as they do)."""
        router = cells.router
        for name in cells.cells:
            for reason in Reason:
                self.routed.labels(name, reason.value)
            self.prompt_blocks.labels(name)
            self.matched_blocks.labels(name)
            self.load.labels(name).set_function(lambda n=name: router.load(n))
            self.alive.labels(name).set_function(lambda n=name: float(router.alive(n)))

    def on_route(self, route: Route) -> None:
        self.routed.labels(route.cell, route.reason.value).inc()
        self.prompt_blocks.labels(route.cell).inc(route.prompt_blocks)
        self.matched_blocks.labels(route.cell).inc(route.matched_blocks)
