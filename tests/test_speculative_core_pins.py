"""What the speculation group's first mutation run left unpinned in the length rule
(scheduler_svc/speculation/length.py), the running acceptance rate, a draft in the core
(scheduler_svc/core/drafts.py) and the worker's verification (worker_svc/verify.py): the cost
of one more draft token, the time limit's slack, ties that do not pay, the counters, a
malformed answer, two drafts in one step, the rate a shadowed proposal measures, and the
worker's generator for an unseeded row."""

from __future__ import annotations

import pytest
import torch

from llmcommon.sampling import SamplingParams
from scheduler_svc.config import DraftLength
from scheduler_svc.output import Outputs
from scheduler_svc.speculation.acceptance import next_rate
from scheduler_svc.speculation.length import (
    SLACK,
    Row,
    auto_lengths,
    fixed_lengths,
    token_shape,
    worth_drafting,
)
from scheduler_svc.step_cost import BatchShape, CostModel
from tests import spec_sim
from tests.test_speculative_core import SPEC, make, request
from worker_svc import verify
from worker_svc.work import WorkItem

ONE = BatchShape.of([(10, 1, True)])  # one decode at position 10


def by_tokens(*seconds: float):
    """A predictor of the step's time by its tokens: seconds[n - 1] for n tokens."""
    return lambda shape: seconds[shape.tokens - 1] if shape.tokens else 0.0


# ---- the length rule -------------------------------------------------------------------------


@pytest.mark.parametrize("start", [0, 7, 300])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_one_more_draft_token_is_the_difference_of_two_drafts(start: int, k: int) -> None:
    more, less = BatchShape.draft(start, k + 1), BatchShape.draft(start, k)
    want = BatchShape(
        more.tokens - less.tokens,
        more.sampled - less.sampled,
        more.kv_read - less.kv_read,
        more.attention - less.attention,
    )
    assert token_shape(start, k) == want == BatchShape(1, 1, 1, start + k + 2)


def test_a_token_predicted_at_the_limit_or_within_its_slack_fits() -> None:
    row = [Row(10, 1, 0.9)]
    for at in (0.5, 0.5 + SLACK):
        predict = by_tokens(0.45, at, at)
        assert auto_lengths(row, ONE, 1, predict, 8, 0.5) == [1]
        assert fixed_lengths(row, ONE, predict, 8, 0.5) == [1]
        assert worth_drafting(ONE, 1, predict, 0.9, 10, 0.5)
    over = by_tokens(0.45, 0.5 + 3 * SLACK)
    assert auto_lengths(row, ONE, 1, over, 8, 0.5) == [0]
    assert fixed_lengths(row, ONE, over, 8, 0.5) == [0]
    assert not worth_drafting(ONE, 1, over, 0.9, 10, 0.5)


def test_a_row_past_the_limit_leaves_the_tokens_of_shorter_contexts() -> None:
    """The likelier row's long context puts its token past the limit; the other's still fits."""
    cost = CostModel(fixed=0.01, per_attention=1e-6)
    base = BatchShape.of([(20_000, 1, True), (10, 1, True)])
    rows = [Row(20_000, 3, 0.95), Row(10, 3, 0.6)]
    limit = cost.predict(base) + 0.001  # room for short-context tokens, not for a long one's
    lengths = auto_lengths(rows, base, 2, cost.predict, 8, limit)
    assert lengths[0] == 0 and lengths[1] >= 1


def test_a_draft_token_that_leaves_tokens_per_second_as_they_were_is_not_taken() -> None:
    """1 token in 0.5 s; a token worth 0.5 that makes it 1.5 in 0.75 s: 2 tokens/s either way."""
    tie = by_tokens(0.5, 0.75)
    assert auto_lengths([Row(10, 1, 0.5)], ONE, 1, tie, 8, 0.0) == [0]
    assert not worth_drafting(ONE, 1, tie, 0.5, 10, 0.0)
    assert auto_lengths([Row(10, 1, 0.5)], ONE, 1, by_tokens(0.5, 0.74), 8, 0.0) == [1]


def test_worth_drafting_prices_the_first_draft_token_at_the_shortest_context() -> None:
    """10 s fixed plus one per attention unit; from position 0 the first token costs 3 units
    (the second would cost 4): it pays at a rate of 0.25, the second would not."""

    def predict(shape: BatchShape) -> float:
        return 10.0 + shape.attention if shape.tokens else 0.0

    base = BatchShape.of([(0, 1, True)])
    assert worth_drafting(base, 1, predict, 0.25, 0, 0.0)
    assert not worth_drafting(base, 1, predict, 0.15, 0, 0.0)


def test_rows_without_room_or_acceptance_draft_nothing() -> None:
    flat = by_tokens(*[0.01] * 20)  # tokens free: every row would draft all it may
    rows = [Row(10, 0, 0.9), Row(10, 1, 0.9), Row(10, 3, 0.0)]
    base = BatchShape.of([(10, 1, True)] * 3)
    assert auto_lengths(rows, base, 3, flat, 16, 0.0) == [0, 1, 0]


def test_a_draft_of_nothing_leaves_the_rate() -> None:
    assert next_rate(0.7, 0, 0) == 0.7


# ---- a draft in the core ---------------------------------------------------------------------


def drafting_steps(core, limit: int = 200):
    """Steps until every request ends, with the rate each draft's request had before."""
    for _ in range(limit):
        step = core.schedule(0)
        if not step.has_work:
            return
        before = [(d.seq, d.seq.acceptance, len(d.token_ids)) for d in step.drafts]
        tokens, emitted = spec_sim.run(step)
        yield step, before, tokens, emitted


def test_counters_and_rates_follow_each_draft() -> None:
    core = make(speculative_length=DraftLength.FIXED, **SPEC)
    seqs = [request("a", 30), request("b", 17, prompt=[4, 6, 9, 4, 6])]
    for s in seqs:
        core.add(s)
    drafts = accepted = 0
    for step, before, tokens, emitted in drafting_steps(core):
        core.complete(step, tokens, emitted)
        for (seq, rate, drafted), n in zip(before, emitted, strict=True):
            assert seq.acceptance == pytest.approx(next_rate(rate, drafted, n - 1))
            drafts, accepted = drafts + 1, accepted + n - 1
    assert drafts > 2 and core.spec_drafts == drafts and core.spec_accepted_tokens == accepted
    assert core.generated == sum(len(s.output_ids) for s in seqs) == 47


def test_two_drafts_in_a_step_give_both_requests_their_tokens() -> None:
    core = make(speculative_length=DraftLength.FIXED, **SPEC)
    a, b = request("a", 30), request("b", 30, prompt=[4, 6, 9, 4, 6])
    core.add(a)
    core.add(b)
    for step, _, tokens, emitted in drafting_steps(core):
        if len(step.drafts) == 2:
            out: Outputs = core.complete(step, tokens, emitted)
            got = out.tokens
            assert [got.seqs.count(a), got.seqs.count(b)] == emitted
            assert got.tokens == tokens
            return
        core.complete(step, tokens, emitted)
    raise AssertionError("never two drafts in one step")


@pytest.mark.parametrize(
    "answer",
    [
        lambda tokens, emitted, k: (tokens, emitted + [0]),  # a count too many, the sum right
        lambda tokens, emitted, k: (tokens + [3], emitted),  # a token too many
        lambda tokens, emitted, k: (tokens + [3] * (k + 2 - emitted[0]), [k + 2]),  # past k + 1
    ],
    ids=["counts", "tokens", "past k+1"],
)
def test_an_answer_that_does_not_match_the_drafts_is_refused_naming_them(answer) -> None:
    core = make(speculative_length=DraftLength.FIXED, **SPEC)
    core.add(request("a", 30))
    for step, _, tokens, emitted in drafting_steps(core):
        if len(step.drafts) == 1:
            k = len(step.drafts[0].token_ids)
            with pytest.raises(ValueError, match="emitted"):
                core.complete(step, *answer(tokens, emitted, k))
            return
        core.complete(step, tokens, emitted)
    raise AssertionError("never drafted")


def test_a_slow_step_drafts_without_a_time_budget() -> None:
    """No step-time budget: nothing limits a draft by time, however slow the step."""
    core = make(cost=CostModel(fixed=2.0), speculative_length=DraftLength.FIXED, **SPEC)
    core.add(request("a", 30))
    assert any(step.drafts for step, *_ in _completing(core))


def _completing(core):
    for step, before, tokens, emitted in drafting_steps(core):
        core.complete(step, tokens, emitted)
        yield step, before, tokens, emitted


def test_auto_fits_its_drafts_to_the_step_time_budget() -> None:
    """As the fixed length's test: 52 ms leave 3 draft tokens of 0.5 ms beside the decode."""
    core = make(step_time_budget_ms=52.0, speculative_length=DraftLength.AUTO, **SPEC)
    core.add(request("r", 40))
    lengths = [len(s.drafts[0].token_ids) for s, *_ in _completing(core) if s.drafts]
    assert lengths and max(lengths) == 3


def test_a_proposal_auto_does_not_take_measures_its_rate_from_the_token_sampled() -> None:
    """Two requests whose rates fell: auto gives them no draft, but each step's sampled token
    says whether their proposal's first token was right, so each rate moves as a one-token
    draft would move it (kept or not: early proposals miss, later ones hit)."""
    core = make(speculative_length=DraftLength.AUTO, **SPEC)
    seqs = [request("a", 40), request("b", 40, prompt=[4, 6, 9, 4, 6])]
    for s in seqs:
        core.add(s)
    shadowed = kept = 0
    for _ in range(200):
        for s in seqs:
            if len(s.output_ids) < 12:
                s.acceptance = 0.01  # fallen: auto drafts nothing for them
        step = core.schedule(0)
        if not step.has_work:
            break
        rates = {s.request_id: s.acceptance for s in step.decodes}
        shadows = [(step.decodes[at], guess) for at, _, guess in step.shadows]
        tokens, emitted = spec_sim.run(step)
        first = sum(1 for w in step.chunks if w.sample)
        sampled = dict(zip(step.decodes, tokens[first : first + len(step.decodes)], strict=True))
        core.complete(step, tokens, emitted)
        for seq, guess in shadows:
            right = int(sampled[seq] == guess)
            assert seq.acceptance == pytest.approx(next_rate(rates[seq.request_id], 1, right))
            shadowed, kept = shadowed + 1, kept + right
    assert shadowed >= 4 and 0 < kept < shadowed
    assert all(len(s.output_ids) == 40 for s in seqs)


# ---- the worker's verification ---------------------------------------------------------------


def test_an_unseeded_row_draws_from_the_workers_generator() -> None:
    """Uniform over 64 tokens, a draft of one: what is kept and drawn follows the generator
    handed to emit (the same seed, the same tokens), not torch's global one."""
    logits = torch.zeros(2, 64)
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        rng = torch.Generator().manual_seed(5)
        drawn = []
        for _ in range(20):
            item = WorkItem(
                "r", [0, 9], 10, list(range(8)), sampling=SamplingParams(temperature=1.0)
            )
            item.drafted = 1
            drawn.append([t for t, _ in verify.emit(logits, [item], [0], rng)[0]])
        runs.append(drawn)
    assert runs[0] == runs[1]


def test_beside_a_draft_each_shadow_is_the_proposal_of_its_own_request() -> None:
    """Four requests, the first drafting (its rate high), the three after it not (theirs fallen):
    the drafts leave the step's decodes shifted, and each shadow still pairs a decode with its
    own request's proposal, measured by its own sampled token."""
    core = make(speculative_length=DraftLength.AUTO, **SPEC)
    seqs = [
        request("a", 40),
        request("b", 40, prompt=[4, 6, 9, 4, 6]),
        request("c", 40, prompt=[7, 3, 7, 3, 7]),
        request("d", 40, prompt=[9, 5, 2, 9, 5]),
    ]
    for s in seqs:
        core.add(s)
    checked = 0
    for _ in range(200):
        seqs[0].acceptance = 0.95
        for s in seqs[1:]:
            s.acceptance = 0.01
        step = core.schedule(0)
        if not step.has_work:
            break
        proposals = {
            s.request_id: core.proposer.propose(s, 1) for s in step.decodes if s is not seqs[0]
        }
        want = {rid: p[0] for rid, p in proposals.items() if p}
        got = {step.decodes[at].request_id: guess for at, _, guess in step.shadows}
        assert all(step.decode_handles[at] == h for at, h, _ in step.shadows)
        if step.drafts:  # past `auto`'s first check: every proposal was looked up
            assert got == want
            checked += len(want) == 3
        spec_sim.complete(core, step)
    assert checked >= 3
    assert all(len(s.output_ids) == 40 for s in seqs)


def test_a_budget_of_one_token_left_drafts_one() -> None:
    core = make(token_budget=2, speculative_length=DraftLength.FIXED, **SPEC)
    core.add(request("a", 30))
    lengths = [len(s.drafts[0].token_ids) for s, *_ in _completing(core) if s.drafts]
    assert lengths and set(lengths) == {1}
