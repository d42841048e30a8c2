"""Drive the scheduler core without a model: a deterministic fake sampler stands in."""

from __future__ import annotations

from scheduler_svc import invariants
from scheduler_svc.core import Scheduler
from scheduler_svc.plan import WorkerBatch
from scheduler_svc.sequence import Sequence


def fake_token(tokens: list[int]) -> int:
    """A 'model' whose next token depends on the whole context, like a real one."""
    return (sum(tokens) * 31 + len(tokens)) % 997 + 3


def seq(rid: str, prompt: int, max_tokens: int, **kw) -> Sequence:
    base = sum(map(ord, rid))
    ids = [(base * 7 + i) % 500 + 3 for i in range(prompt)]
    return Sequence(rid, ids, max_tokens, **kw)


def step(core: Scheduler) -> list[WorkerBatch]:
    """One execution: schedule, 'run the model', post-process. Returns what ran."""
    batches = core.schedule()
    sampled = {
        w.seq.request_id: fake_token(w.seq.tokens) for b in batches for w in b.items if w.sample
    }
    core.postprocess(batches, sampled)
    return batches


def ran(batches: list[WorkerBatch]) -> dict[str, int]:
    """request id -> tokens processed in this execution."""
    return {w.seq.request_id: w.num_tokens for b in batches for w in b.items}


def check_invariants(core: Scheduler) -> None:
    """The service's own checks (also run by the scheduler under LLMSERVE_CHECK_INVARIANTS=1)."""
    invariants.check_invariants(core)
