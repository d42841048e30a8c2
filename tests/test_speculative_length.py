"""How long drafts are (`--speculative-length`): `auto` maximises the step's expected emitted
tokens per predicted second from each request's acceptance rate and the worker's step-time
model, so it drafts long at one stream with high acceptance and falls to 0 by itself in a
large batch whose time grows with its tokens; `fixed` drafts all it may. A draft row is priced
as a chunk of 1 + k tokens that samples every row, and the online step-time model predicts
steps with drafts as well as without."""

from __future__ import annotations

import random

from scheduler_svc.config import CoreConfig, DraftLength, Speculative, WorkerSpec
from scheduler_svc.core import Scheduler
from scheduler_svc.sequence import Sequence
from scheduler_svc.speculation.acceptance import expected_emitted, next_rate
from scheduler_svc.speculation.length import Row, auto_lengths, fixed_lengths, worth_drafting
from scheduler_svc.step_cost import BatchShape, CostModel
from scheduler_svc.step_model import OnlineStepModel
from tests import spec_sim

SPEC = {"speculative": Speculative.NGRAM, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
LOADED = CostModel(fixed=0.005, per_token=0.001, per_sampled=0.0002)  # tokens cost
ONE_STREAM = CostModel(fixed=0.01, per_token=0.002)  # a decode is mostly its fixed cost


def decodes(n: int, context: int = 100) -> BatchShape:
    return BatchShape.of([(context, 1, True)] * n)


def test_the_expected_tokens_of_a_draft_follow_the_geometric_rule() -> None:
    assert expected_emitted(0.5, 0) == 1.0
    assert abs(expected_emitted(0.5, 2) - 1.75) < 1e-12
    assert expected_emitted(1.0, 4) == 5.0
    assert next_rate(0.5, 4, 4) == 0.5 + 0.3 * 0.5  # all kept: the draft's estimate is 1
    assert next_rate(0.5, 4, 0) == 0.5 - 0.3 * 0.5  # the first rejected: 0
    assert abs(next_rate(0.5, 4, 1) - 0.5) < 1e-12  # one of two tried: 1/2


def test_auto_drafts_nothing_in_a_heavy_batch_where_tokens_cost() -> None:
    rows = [Row(100, 5, 0.9)] * 64
    assert auto_lengths(rows, decodes(64), 64, LOADED.predict, 10_000, 0.0) == [0] * 64
    assert fixed_lengths(rows, decodes(64), LOADED.predict, 10_000, 0.0) == [5] * 64


def test_auto_drafts_at_one_stream_and_longer_as_acceptance_rises() -> None:
    lengths = {
        rate: auto_lengths([Row(100, 5, rate)], decodes(1), 1, ONE_STREAM.predict, 100, 0.0)[0]
        for rate in (0.1, 0.5, 0.95)
    }
    assert lengths == {0.1: 0, 0.5: 2, 0.95: 5}
    # the same request in the heavy batch's cost: a little, never more than alone
    assert auto_lengths([Row(100, 5, 0.95)], decodes(1), 1, LOADED.predict, 100, 0.0) == [5]


def test_auto_gives_draft_tokens_to_the_likeliest_rows_first_within_the_budget() -> None:
    rows = [Row(100, 5, 0.3), Row(100, 5, 0.9), Row(100, 5, 0.6)]
    lengths = auto_lengths(rows, decodes(3), 3, ONE_STREAM.predict, 4, 0.0)
    assert sum(lengths) == 4 and lengths[1] >= lengths[2] >= lengths[0]
    assert lengths[1] >= 2


def test_drafts_stay_within_the_time_limit() -> None:
    base = decodes(2)
    limit = ONE_STREAM.predict(base) + 3 * 0.002 + 1e-9  # room for three draft tokens
    rows = [Row(100, 5, 0.95), Row(100, 5, 0.95)]
    assert sum(auto_lengths(rows, base, 2, ONE_STREAM.predict, 100, limit)) == 3
    assert fixed_lengths(rows, base, ONE_STREAM.predict, 100, limit) == [3, 0]


def make(cost: CostModel, **cfg) -> Scheduler:
    cfg.setdefault("token_budget", 256)
    cfg.setdefault("max_running", 64)
    spec = WorkerSpec("w0", 4096, 4, 4096)
    return Scheduler(
        CoreConfig(**SPEC, **cfg), [spec], predict=lambda worker, shape: cost.predict(shape)
    )


def test_in_the_core_draft_lengths_rise_with_acceptance_at_one_stream() -> None:
    core = make(ONE_STREAM, speculative_length=DraftLength.AUTO)
    core.add(r := Sequence("r", [3, 5, 8, 4], 60))
    lengths = [len(s.drafts[0].token_ids) for s in spec_sim.drive(core) if s.drafts]
    assert lengths[0] == 2 and max(lengths) == 5  # the prior's 0.5, then every draft kept
    rising = lengths[: lengths.index(5) + 1]
    assert rising == sorted(rising)
    assert r.acceptance > 0.9 and len(r.output_ids) == 60


def test_in_the_core_auto_falls_to_zero_in_a_heavy_batch() -> None:
    """48 decoding requests whose proposals exist (a repeating model) and a step time that
    grows with tokens: once every prompt is in and every request has sampled a few tokens, no
    step drafts; `fixed` drafts in those steps."""
    for length, drafting in ((DraftLength.AUTO, False), (DraftLength.FIXED, True)):
        core = make(LOADED, speculative_length=length)
        seqs = [Sequence(f"r{i}", [3 + i % 5, 5, 8, 3 + i % 5, 5], 30) for i in range(48)]
        for s in seqs:
            core.add(s)
        steady = []
        while not all(s.is_finished for s in seqs):
            for step in spec_sim.step(core):
                if not step.chunks and all(len(q.output_ids) >= 4 for q in seqs):
                    steady.append(len(step.drafts))
        assert steady and (sum(steady) > 0) is drafting, (length, steady)
        assert all(len(s.output_ids) == 30 for s in seqs)


def test_the_step_model_predicts_steps_with_drafts_as_well_as_without() -> None:
    """A worker whose steps take a linear cost of their work, with a measured noise of up to
    +-10%: the online model's p50 and p90 error over steps with drafts in the batch (a third
    of the rows, 1 to 5 draft tokens each, priced as chunks that sample every row) are within
    5 points of its error over steps without."""
    truth = CostModel(
        fixed=0.012, per_token=0.0011, per_sampled=0.0004, per_kv_read=3e-6, per_attention=2e-7
    )
    errors = {}
    for with_drafts in (False, True):
        rng, model = random.Random(3), OnlineStepModel()
        for _ in range(400):
            shape = BatchShape()
            for _ in range(rng.randint(1, 32)):
                start = rng.randint(16, 2000)
                if with_drafts and rng.random() < 1 / 3:
                    shape += BatchShape.draft(start, rng.randint(1, 5))
                else:
                    shape += BatchShape.item(start, 1, True)
            if rng.random() < 0.2:  # now and then a prompt chunk joins
                shape += BatchShape.item(0, rng.randint(16, 256), True)
            model.observe(shape, truth.predict(shape) * rng.uniform(0.9, 1.1))
        errors[with_drafts] = model.error()
    without, with_ = errors[False], errors[True]
    assert abs(with_.p50 - without.p50) <= 0.05 and abs(with_.p90 - without.p90) <= 0.05
    assert with_.p90 < 0.2


def test_under_load_auto_looks_up_no_proposal_at_all() -> None:
    """In the heavy batch's steady state the core asks the proposer nothing: the likeliest,
    cheapest draft token would not pay, so no row's tokens are searched."""
    core = make(LOADED, speculative_length=DraftLength.AUTO)
    seqs = [Sequence(f"r{i}", [3 + i % 5, 5, 8, 3 + i % 5, 5], 30) for i in range(48)]
    for s in seqs:
        core.add(s)
    asked = []
    assert core.proposer is not None
    propose = core.proposer.propose

    def counted(seq, k, skip=0):
        asked.append(seq.request_id)
        return propose(seq, k, skip)

    core.proposer.propose = counted
    while not all(len(q.output_ids) >= 4 for q in seqs):
        spec_sim.step(core)
    asked.clear()
    spec_sim.step(core)
    assert asked == []
    assert worth_drafting(decodes(1), 1, ONE_STREAM.predict, 0.5, 100, 0.0)
    assert not worth_drafting(decodes(64), 64, LOADED.predict, 0.9, 100, 0.0)


def test_a_request_whose_rate_fell_is_measured_again_by_its_proposals_and_drafts_again() -> None:
    """A request whose acceptance rate is near 0 drafts nothing under auto, but each decode
    that had a proposal tells whether its first token was right: the rate climbs back while
    the text repeats, and the request drafts again (without this, it never would)."""
    core = make(ONE_STREAM, speculative_length=DraftLength.AUTO)
    core.add(r := Sequence("r", [3, 5, 8, 4], 60))
    r.acceptance = 0.01
    history = spec_sim.drive(core)
    first = next(i for i, s in enumerate(history) if s.drafts)
    assert first > 2  # some plain decodes first: their shadows raised the rate
    assert any(s.shadows for s in history[:first])
    assert r.acceptance > 0.9 and len(r.output_ids) == 60
