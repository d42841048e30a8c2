"""Random workloads with speculation against the same without: small pools (preemption), small
budgets, stop tokens, one or two workers, overlap or not, fixed or auto lengths, drafts the
model accepts in part. Every invariant holds after every step, every planned step is its
worker's own, every output is the one without speculation, and every block comes back."""

from __future__ import annotations

import random

import pytest

from scheduler_svc import invariants
from scheduler_svc.config import CoreConfig, DraftLength, Speculative, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.sequence import Sequence
from scheduler_svc.step_cost import CostModel
from tests import spec_sim

COST = CostModel(fixed=0.02, per_token=0.001)


def model(context: list[int]) -> int:
    """Repeats itself often (drafts are found), not always (drafts are rejected in part)."""
    a, b = context[-1], context[-2] if len(context) > 1 else 0
    return (a * 5 + (b % 3) * 2) % 13 + 3


def workload(rng: random.Random) -> list[Sequence]:
    seqs = []
    for i in range(rng.randint(1, 6)):
        prompt = [rng.choice([3, 4, 5, 6, 7]) for _ in range(rng.randint(2, 14))]
        stops = frozenset({rng.randrange(3, 16)}) if rng.random() < 0.5 else frozenset()
        seqs.append(Sequence(f"r{i}", prompt, rng.randint(1, 30), eos_ids=stops))
    return seqs


def run(seed: int, speculate: bool) -> tuple[Scheduler, dict[str, list[int]]]:
    rng = random.Random(seed)
    block = rng.choice([1, 2, 4])
    workers = rng.choice([1, 1, 2])
    overlap = workers == 1 and rng.random() < 0.5
    cfg = dict(token_budget=rng.choice([4, 8, 16, 64]), max_running=rng.choice([2, 4, 8]))
    speculation = dict(  # drawn either way: the same workload follows
        speculative=rng.choice([Speculative.NGRAM, Speculative.NGRAM_SUFFIX]),
        speculative_length=rng.choice([DraftLength.FIXED, DraftLength.AUTO]),
        num_speculative_tokens=rng.randint(1, 6),
        prompt_lookup_min=rng.randint(1, 2),
        prompt_lookup_max=3,
    )
    if speculate:
        cfg |= speculation
    blocks = rng.randint(48, 80) // block
    specs = [WorkerSpec(f"w{i}", blocks, block, 4096) for i in range(workers)]
    core = Scheduler(CoreConfig(**cfg), specs, predict=lambda w, shape: COST.predict(shape))
    seqs = workload(rng)
    for s in seqs:
        core.add(s)
    if overlap:
        spec_sim.Overlapped(core, model).drive()
    else:
        spec_sim.drive(core, model)
    invariants.check_invariants(core)
    for ws in core.workers:
        assert ws.kv.pool.num_free == ws.spec.num_blocks
    return core, {s.request_id: list(s.output_ids) for s in seqs}


@pytest.mark.parametrize("seed", range(40))
def test_outputs_with_speculation_are_those_without(seed: int) -> None:
    _, want = run(seed, speculate=False)
    core, got = run(seed, speculate=True)
    assert got == want


def test_the_random_workloads_draft_reject_and_preempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the cases above go through, together: drafts accepted and rejected, preemptions
    (some of a request whose draft is in flight), and steps cut short by stop tokens."""
    drafts = accepted = drafted = 0
    mid_draft: list[bool] = []
    preempt = Scheduler._preempt

    def spy(self: Scheduler, ws, seq, cache=True) -> None:
        mid_draft.append(seq.drafting)
        preempt(self, ws, seq, cache)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    for seed in range(40):
        core, _ = run(seed, speculate=True)
        drafts += core.spec_drafts
        accepted += core.spec_accepted_tokens
        drafted += core.spec_draft_tokens
    assert drafts > 100 and 0 < accepted < drafted
    assert len(mid_draft) > 10 and any(mid_draft)
