"""A fake worker for speculative decoding: a 'model' whose greedy next token is a rule of the
context, and a verifier that keeps a draft's tokens while they equal the model's, then adds
the model's own next token (greedy verification, as worker_svc/verify.py does). Its outputs are
those of one token per step, whatever the drafts."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc import invariants
from scheduler_svc.core import Scheduler
from scheduler_svc.output import Outputs
from scheduler_svc.step import Step

Model = Callable[[list[int]], int]


def cycling(context: list[int]) -> int:
    """A model that repeats itself: its next token depends on the last one only, so its output
    falls into a cycle of at most 11 tokens that prompt lookup finds."""
    return (context[-1] * 7 + 3) % 11 + 3


def mixed(context: list[int]) -> int:
    """`cycling`, but for a context that starts with token 1: a count that never repeats (its
    request never finds a proposal)."""
    return 1000 + len(context) if context[0] == 1 else cycling(context)


def run(step: Step, model: Model = cycling) -> tuple[list[int], list[int]]:
    """What the worker answers for `step`: its tokens (chunks, decodes, then the drafts') and
    `emitted` (tokens per draft). The context of a request is what the core knows when the step
    completes (the steps before it have completed), which is what the worker holds."""
    if step.repeat > 1:  # a decode run: each execution feeds the next the token it sampled
        contexts = [list(s.tokens) for s in step.decodes]
        ran = []
        for _ in range(step.repeat):
            for context in contexts:
                context.append(model(context))
                ran.append(context[-1])
        return ran, []
    tokens = [model(w.seq.tokens) for w in step.chunks if w.sample]
    tokens += [model(s.tokens) for s in step.decodes]
    emitted = []
    for draft in step.drafts:
        context = list(draft.seq.tokens)
        kept = []
        for token in draft.token_ids:
            if model(context) != token:
                break
            kept.append(token)
            context.append(token)
        kept.append(model(context))
        tokens += kept
        emitted.append(len(kept))
    return tokens, emitted


def complete(core: Scheduler, step: Step, model: Model = cycling) -> Outputs:
    tokens, emitted = run(step, model)
    return core.complete(step, tokens, emitted)


def step(core: Scheduler, model: Model = cycling) -> list[Step]:
    """One execution on every worker, each planned step and the core checked."""
    steps = core.schedule_all()
    for s in steps:
        invariants.check_step(core, s)
    for s in steps:
        complete(core, s, model)
    invariants.check_invariants(core)
    return steps


def drive(core: Scheduler, model: Model = cycling, limit: int = 500) -> list[Step]:
    """Every step until nothing is left; the steps that ran."""
    history: list[Step] = []
    for _ in range(limit):
        steps = step(core, model)
        history += [s for s in steps if s.has_work]
        if not steps and not core.waiting and not any(ws.running for ws in core.workers):
            return history
    raise AssertionError("did not finish")


class Overlapped:
    """One worker driven with overlap: step N+1 planned before N completes."""

    def __init__(self, core: Scheduler, model: Model = cycling) -> None:
        self.core, self.model = core, model
        self.inflight: Step | None = None

    def step(self) -> Step:
        planned = self.core.schedule(0)
        invariants.check_step(self.core, planned)
        self.flush()
        self.inflight = planned if planned.has_work or planned.released else None
        return planned

    def flush(self) -> None:
        if self.inflight is not None:
            complete(self.core, self.inflight, self.model)
            self.inflight = None
        invariants.check_invariants(self.core)

    def drive(self, limit: int = 500) -> None:
        for _ in range(limit):
            planned = self.step()
            if not planned.has_work and self.inflight is None:
                if not self.core.waiting and not self.core.workers[0].running:
                    return
        raise AssertionError("did not finish")
