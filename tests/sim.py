"""Drive the scheduler core without a model: a deterministic fake sampler stands in."""

from __future__ import annotations

from scheduler_svc import invariants
from scheduler_svc.core import Scheduler
from scheduler_svc.sequence import Sequence
from scheduler_svc.step import Step


def fake_token(tokens: list[int]) -> int:
    """A 'model' whose next token depends on the whole context, like a real one."""
    return (sum(tokens) * 31 + len(tokens)) % 997 + 3


def seq(rid: str, prompt: int, max_tokens: int, **kw) -> Sequence:
    base = sum(map(ord, rid))
    ids = [(base * 7 + i) % 500 + 3 for i in range(prompt)]
    return Sequence(rid, ids, max_tokens, **kw)


def sample(step: Step) -> list[int]:
    """What a worker would sample: the next token of each sampled request's whole context.
    With overlap the core does not know the token still in flight, the worker does; the fake
    model's context is what the core knows when the step completes, which is the same."""
    return [fake_token(s.tokens) for s in step.sampled_seqs()]


def step(core: Scheduler) -> list[Step]:
    """One execution on every worker: schedule, 'run the model', post-process. Returns what ran.
    Each planned step is checked: its work is its worker's own (scheduler_svc/invariants.py)."""
    steps = core.schedule_all()
    for s in steps:
        invariants.check_step(core, s)
    for s in steps:
        core.complete(s, sample(s))
    return steps


def ran(steps: list[Step]) -> dict[str, int]:
    """request id -> tokens processed in this execution."""
    out: dict[str, int] = {}
    for s in steps:
        out.update(s.ran())
    return out


class Overlapped:
    """One worker driven as the service drives it with overlap: step N+1 is planned before step
    N's tokens are known, then N completes."""

    def __init__(self, core: Scheduler, worker: int = 0) -> None:
        self.core, self.worker = core, worker
        self.inflight: Step | None = None

    def step(self) -> Step:
        """Plan and send the next step, then complete the one before it. Returns the new one."""
        planned = self.core.schedule(self.worker)
        invariants.check_step(self.core, planned)
        if self.inflight is not None:
            self.core.complete(self.inflight, sample(self.inflight))
        self.inflight = planned
        return planned

    def flush(self) -> None:
        if self.inflight is not None:
            self.core.complete(self.inflight, sample(self.inflight))
            self.inflight = None


def check_invariants(core: Scheduler) -> None:
    """The service's own checks (also run by the scheduler under LLMSERVE_CHECK_INVARIANTS=1)."""
    invariants.check_invariants(core)
