"""Several cells behind one router on a virtual clock: each cell is a `Simulation` (the real
scheduler core and its simulated workers), and the gateway's own router (gateway/routing/)
picks the cell of every request from its prompt's block keys and the cells' loads.

The cells share one clock and one set of request records; a conversation's next turn is built
from its previous turn's prompt and output wherever that ran, then routed afresh (so a router
that sends it elsewhere loses the cached history, as a real one would). A request's weight in
its cell's load is its prompt tokens not cached there and its max_tokens, what a gateway knows.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, replace

from gateway.routing import Reason, Route, Router, RouterSettings, prompt_keys
from llmserve.bench.cost_model import CostModel
from llmserve.bench.policy import Policy
from llmserve.bench.poller import prefix_counters
from llmserve.bench.records import RunResult
from llmserve.bench.simulate import SimSettings, Simulation
from llmserve.bench.workload import RequestSpec, Workload


@dataclass(frozen=True, slots=True)
class CellFigures:
    """What the router did to the cells over a run."""

    busy_s: list[float]  # per cell, its workers' step seconds summed
    hit_tokens: int  # prompt tokens the cells' prefix caches served
    prompt_tokens: int  # prompt tokens the cells were asked to prefill
    reasons: dict[str, int]  # routes per reason

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float:
        """The busiest cell's busy time over the mean's (1: perfectly even)."""
        mean = sum(self.busy_s) / len(self.busy_s)
        return max(self.busy_s) / mean if mean else 1.0


class CellsSimulation:
    def __init__(
        self,
        settings: SimSettings,
        policy: Policy,
        cost: CostModel,
        cells: int,
        router: RouterSettings,
    ) -> None:
        self.settings, self.policy = settings, policy
        self.now = 0.0
        self.cells = [Simulation(settings, policy, cost) for _ in range(cells)]
        first = self.cells[0]
        for cell in self.cells[1:]:  # one set of records, one history per conversation
            cell.records, cell.last_token, cell.target = (
                first.records,
                first.last_token,
                first.target,
            )
            cell.kept = first.kept
        router = replace(router, block_size=settings.block_size)
        self.router = Router([f"cell{i}" for i in range(cells)], router, clock=lambda: self.now)
        self.routes: dict[str, Route] = {}
        self.root: dict[int, int] = {}  # request -> its conversation's first request
        self.reasons: dict[str, int] = {r.value: 0 for r in Reason}
        self.arrivals: list[tuple[float, int, RequestSpec]] = []
        self.followers: dict[int, RequestSpec] = {}

    @property
    def label(self) -> str:
        return self.router.settings.policy.value

    def run(self, workload: Workload) -> RunResult:
        started = time.perf_counter()
        self.followers = workload.followers()
        for cell in self.cells:
            cell.content, cell.followers = workload.content, self.followers
        if workload.closed:
            raise ValueError("bench sim --cells replays open-loop workloads (--concurrency 0)")
        for spec in workload.roots:
            self._due(spec.arrival_s or 0.0, spec)
        while True:
            for cell in self.cells:
                cell.now = self.now
            while self.arrivals and self.arrivals[0][0] <= self.now:
                due, _, spec = heapq.heappop(self.arrivals)
                self._arrive(spec, due)
            for cell in self.cells:
                self._finished(cell._complete_due())
            for cell in self.cells:
                self._finished(cell._start_idle())
            upcoming = [run.end for cell in self.cells for run in cell.inflight.values()]
            if self.arrivals:
                upcoming.append(self.arrivals[0][0])
            if not upcoming:
                break
            self.now = max(self.now, min(upcoming))
        stuck = [cell for cell in self.cells if cell.core.waiting]
        if stuck:
            raise RuntimeError(f"nothing can run: {stuck[0].core.head_reason}")
        return self._result(time.perf_counter() - started)

    def figures(self) -> CellFigures:
        counters = [prefix_counters(cell.core.snapshot().workers) for cell in self.cells]
        return CellFigures(
            [cell.busy_s for cell in self.cells],
            sum(c.get("cache_hit_tokens", 0) for c in counters),
            sum(c.get("cache_prompt_tokens", 0) for c in counters),
            dict(self.reasons),
        )

    def _due(self, at: float, spec: RequestSpec) -> None:
        heapq.heappush(self.arrivals, (at, spec.index, spec))

    def _arrive(self, spec: RequestSpec, due: float) -> None:
        root = self.root.get(spec.follows, spec.index) if spec.follows >= 0 else spec.index
        self.root[spec.index] = root
        prompt = self.cells[0]._prompt(spec)  # (the history is shared: any cell builds it)
        keys = prompt_keys(prompt, self.settings.block_size)
        route = self.router.route(keys, len(prompt), spec.limit, session=str(root))
        assert route is not None  # (the simulated cells never die)
        self.reasons[route.reason.value] += 1
        rid = str(spec.index)
        self.routes[rid] = route
        cell = self.cells[self.router.slots[route.cell]]
        cell._arrive(spec, due, prompt)
        if cell.records[rid].error:  # refused at the door: its conversation ends there
            self.router.done(self.routes.pop(rid))

    def _finished(self, finished: list[str]) -> None:
        for rid in finished:
            self.router.done(self.routes.pop(rid))
            follower = self.followers.get(int(rid))
            if follower is not None:
                self._due(self.now + follower.think_s, follower)

    def _result(self, wall: float) -> RunResult:
        first = self.cells[0]
        records = sorted(first.records.values(), key=lambda r: r.index)
        figures = self.figures()
        counters = {
            "cells": len(self.cells),
            "router": self.label,
            "virtual_s": self.now,
            "real_s": wall,
            "busy_s": sum(figures.busy_s),
            "cell_busy_s": figures.busy_s,
            "imbalance": figures.imbalance,
            "cache_hit_tokens": figures.hit_tokens,
            "cache_prompt_tokens": figures.prompt_tokens,
            "hit_rate": figures.hit_rate,
            "reasons": figures.reasons,
            "steps": sum(cell.steps for cell in self.cells),
            "preemptions": sum(cell.core.preemptions for cell in self.cells),
            "stalls": {},
            "refused": {},
        }
        return RunResult(
            self.label, records, [], self.now, config={}, counters=counters, kind="simulated"
        )
