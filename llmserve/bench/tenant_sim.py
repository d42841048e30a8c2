"""The simulation with tenants: every step's service per tenant and which tenants were
backlogged when it was planned (fairness.py), kept beside the run's records."""

from __future__ import annotations

from collections import Counter

from llmserve.bench.cost_model import CostModel
from llmserve.bench.fairness import ServiceLedger
from llmserve.bench.policy import Policy
from llmserve.bench.records import RunResult
from llmserve.bench.simulate import SimSettings, Simulation
from llmserve.bench.tenants import sending_until
from llmserve.bench.workload import RequestSpec, Workload
from scheduler_svc.output import Event
from scheduler_svc.sequence import SeqStatus


def has_tenants(workload: Workload) -> bool:
    return any(r.tenancy is not None for r in workload.requests)


def simulation_for(workload: Workload) -> type[Simulation]:
    return TenantSimulation if has_tenants(workload) else Simulation


class TenantSimulation(Simulation):
    """A Simulation that also keeps a ServiceLedger (result.counters["tenants"])."""

    def __init__(self, settings: SimSettings, policy: Policy, cost: CostModel) -> None:
        super().__init__(settings, policy, cost)
        self.ledger = ServiceLedger({})
        self.tenant_of: dict[str, str] = {}
        self.live: Counter[str] = Counter()  # arrived, admitted or not, not finished
        self.until: dict[str, float] = {}

    def run(self, workload: Workload, progress: bool = True) -> RunResult:
        weights: dict[str, float] = {}
        for r in workload.requests:
            if r.tenancy is not None:
                weights.setdefault(r.tenancy.tenant, r.tenancy.weight)
        self.ledger = ServiceLedger(weights)
        self.until = sending_until(workload)
        result = super().run(workload, progress)
        result.counters["tenants"] = self.ledger.figures()
        return result

    def _backlogged(self) -> set[str]:
        """The tenants with requests waiting in the queue (not running on a worker)."""
        running: Counter[str] = Counter()
        for ws in self.core.workers:
            for seq in ws.running:
                if seq.status is SeqStatus.RUNNING:
                    running[seq.tenancy.tenant] += 1
        return {t for t, n in self.live.items() if n > running[t]}

    def _start(self, index: int) -> list[str]:
        backlogged = self._backlogged()
        finished = super()._start(index)
        run = self.inflight.get(index)
        if run is not None:  # the worker was idle: a step it just started
            self.ledger.record(run.step, backlogged)
        return finished

    def _due(self, at: float, spec: RequestSpec) -> None:
        """A closed loop's next request, unless its tenant stopped sending by then."""
        until = self.until.get(spec.tenancy.tenant, 0.0) if spec.tenancy is not None else 0.0
        if not until or at <= until:
            super()._due(at, spec)

    def _arrive(self, spec: RequestSpec, due: float) -> None:
        super()._arrive(spec, due)
        rid = str(spec.index)
        tenant = spec.tenancy.tenant if spec.tenancy is not None else ""
        self.tenant_of[rid] = tenant
        if not self.records[rid].error:
            self.live[tenant] += 1

    def _record(self, events: list[Event]) -> list[str]:
        finished = super()._record(events)
        for rid in finished:
            self.live[self.tenant_of[rid]] -= 1
        return finished
