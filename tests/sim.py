"""Drive the scheduler core without a model: a deterministic fake sampler stands in."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc import invariants
from scheduler_svc.core import Scheduler
from scheduler_svc.output import Event, Outputs
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
    model's context is what the core knows when the step completes, which is the same. A step
    of several executions (--decode-steps) feeds each execution's tokens to the next."""
    out = [fake_token(w.seq.tokens) for w in step.chunks if w.sample]
    contexts = [list(s.tokens) for s in step.decodes]
    for _ in range(step.repeat):
        for context in contexts:
            context.append(fake_token(context))
            out.append(context[-1])
    return out


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


def events_of(result: object) -> list[Event]:
    """The events in what a core call returned: Outputs, finishes, or planned steps."""
    if isinstance(result, Outputs):
        return result.events()
    if isinstance(result, Step):
        return result.failed + result.admissions
    if isinstance(result, list):
        return [e for item in result for e in events_of(item)]
    return [result] if isinstance(result, Event) else []


def _recorded(name: str) -> Callable:
    def call(self: Recording, *args, **kwargs):
        self.depth += 1
        try:
            result = getattr(Scheduler, name)(self, *args, **kwargs)
        finally:
            self.depth -= 1
        if not self.depth:  # a call from outside, not one the core makes of itself
            self.log += events_of(result)
        return result

    call.__name__ = name
    return call


class Recording(Scheduler):
    """The core, keeping in order the events its calls return, for a test to take."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[Event] = []
        self.depth = 0

    schedule_workers = _recorded("schedule_workers")
    complete = _recorded("complete")
    abort = _recorded("abort")
    fail_items = _recorded("fail_items")
    fail_step = _recorded("fail_step")
    fail_unplaceable = _recorded("fail_unplaceable")

    def take_events(self) -> list[Event]:
        log, self.log = self.log, []
        return log


def ids(events: list[Event]) -> list[str]:
    """The request ids of these events, in order."""
    return [e.request_id for e in events]
